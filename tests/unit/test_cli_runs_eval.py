"""`trainctl runs eval` output: pure functions of the API's eval answer. Beside perplexity, per
eval set, the records its latest evaluation scored and skipped, why, a mark past a few percent,
and the first records skipped."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from cli.demo import records_table, skipped_notes


def eval_set(records: int, oversized: int, **extra: Any) -> dict[str, Any]:
    point = {"step": 4, "perplexity": 3.0, "records": records, "oversized_records": oversized}
    latest = {**point, **{k: v for k, v in extra.items() if k == "skipped_records"}}
    summary = {"task": "qa_reasoning", "baseline": None, "latest": latest, "best": point}
    return {**summary, **{k: v for k, v in extra.items() if k == "skipped_examples"}}


def rendered(answer: dict[str, Any]) -> list[str]:
    console = Console(width=80, record=True)
    console.print(records_table(answer))
    for line in skipped_notes(answer):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_runs_eval_shows_scored_and_skipped_per_set_marks_past_two_percent_and_names_them() -> None:
    answer = {
        "tasks": {
            "qa-mixture": eval_set(
                46,
                0,
                skipped_records={"malformed_json": 1, "wrong_shape": 1},
                skipped_examples=["qa.jsonl:5: not valid JSON", "qa.jsonl:10: a text record"],
            ),
            "summarization": eval_set(1046, 3, skipped_records={}, skipped_examples=[]),
            "qa-rag": eval_set(200, 0, skipped_records={"no_target": 5}, skipped_examples=[]),
        }
    }
    lines = rendered(answer)
    header = lines.index("set            scored  skipped  why")
    assert lines[header + 1 : header + 4] == [
        "qa-mixture         46      2 !  1 malformed JSON, 1 wrong shape",
        "qa-rag            200      5 !  5 no target tokens",  # 5 of 205: more than 2 %
        "summarization   1,046        3  3 too long",  # 3 of 1,049: not
    ]
    assert all(len(line) <= 80 for line in lines[: header + 4])
    assert lines[header + 4 :] == [
        "!: more than 2% of the set's records skipped",
        "qa-mixture, the first skipped:",
        "  qa.jsonl:5: not valid JSON",
        "  qa.jsonl:10: a text record",
    ]


def test_an_answer_from_a_service_before_skipped_records_shows_none_skipped() -> None:
    lines = rendered({"tasks": {"qa": eval_set(48, 0)}})
    assert [line.split() for line in lines[-2:]] == [
        ["set", "scored", "skipped", "why"],
        ["qa", "48", "0", "-"],
    ]
