"""The CLI's tables at 80 columns (a pipe, a small terminal): `runs list`, `runs eval` (and
`--by-phase`), `runs compare` and the demo's final tables, with realistic long names. No
number is ever cut ("…") or wrapped: columns are dropped or shortened first."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from rich.console import Console

from cli.compare import comparison_view, evals_table
from cli.demo import eval_table, loss_table
from cli.evaluation import matrix_cell, phase_matrix
from cli.runs import runs_table
from cli.table import FittedTable, number, text

WIDTH = 80
SETS = {
    "continued_pretrain": "continued_pretrain",
    "summarization": "summarization",
    "instruction_tuning": "instruction_tuning",
    "qa-mixture-held-out": "qa_reasoning",
    "qa-rag-held-out": "qa_reasoning",
    "retrieval_planning": "retrieval_planning",
}


def render(renderable: Any, width: int = WIDTH) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def assert_fits_with_numbers_whole(lines: list[str], numbers: list[str], width: int) -> None:
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    text = "\n".join(lines)
    for value in numbers:
        # Whole: not cut, not broken over lines, not run into a neighbour.
        assert re.search(rf"(^|\s){re.escape(value)}(\s|$)", text, re.M), (value, text)
    assert not re.search(r"\d…", text), text


def header(lines: list[str], first: str) -> list[str]:
    """The words of the header line that starts with `first` (a header may wrap above it)."""
    return next(line.split() for line in lines if line.startswith(first))


def point(step: int, ppl: float | None) -> dict[str, Any]:
    return {
        "step": step,
        "perplexity": ppl,
        "cross_entropy": None if ppl is None else math.log(ppl),
    }


def eval_answer() -> dict[str, Any]:
    tasks = {}
    for i, (name, task) in enumerate(SETS.items()):
        tasks[name] = {
            "task": task,
            "baseline": point(0, 512.34 + i),
            "latest": point(1750, 3.25 + i),
            "best": point(1725, 3.2 + i),
            "history": [],
        }
    return {"run_id": "run_0123456789ab", "tasks": tasks}


def test_a_fitted_table_never_cuts_a_number_at_any_width() -> None:
    columns = [text("name", min_width=6), text("note", drop=0), number("loss"), number("tokens")]
    rows = [
        ["a-very-long-phase-name-indeed", "dropped first", "1234.5678", "1,234,567,890"],
        ["short", "", "0.25", "12"],
    ]
    for width in range(20, 100):
        lines = render(FittedTable(columns, rows, repeat=1), width)
        assert_fits_with_numbers_whole(lines, ["1234.5678", "1,234,567,890", "0.25"], width)
    wide = "\n".join(render(FittedTable(columns, rows), 100))
    assert "dropped first" in wide and "a-very-long-phase-name-indeed" in wide
    # Narrow: the note goes first, then the name is shortened, then the numbers part ways.
    narrow = render(FittedTable(columns, rows, repeat=1), 24)
    assert not any("dropped" in line for line in narrow)
    assert sum(1 for line in narrow if line.startswith("name")) == 2


def test_runs_eval_fits_80_columns_and_drops_only_a_task_that_repeats_its_name() -> None:
    lines = render(eval_table(eval_answer()))
    numbers = []
    for i, _ in enumerate(SETS):
        numbers += [f"{512.34 + i:.2f}", f"{3.25 + i:.2f} @1750", f"{3.2 + i:.2f} @1725"]
        numbers.append(f"{(3.25 + i) / (512.34 + i) - 1:+.1%}")
    assert_fits_with_numbers_whole(lines, numbers, WIDTH)
    # Two sets' tasks differ from their names: the task column stays, shortened if need be.
    assert header(lines, "set")[:2] == ["set", "task"]
    assert any("qa_reason" in line for line in lines)

    same = eval_answer()
    same["tasks"] = {name: same["tasks"][name] for name in SETS if SETS[name] == name}
    lines = render(eval_table(same))
    assert header(lines, "set")[:2] == ["set", "baseline"]
    assert "retrieval_planning" in "\n".join(lines)  # whole, now that the task is gone


def test_runs_eval_shows_a_dash_for_a_perplexity_that_was_not_finite() -> None:
    answer = eval_answer()
    first = answer["tasks"]["continued_pretrain"]
    # An untrained model's loss past exp's range: the API answers null, best has none.
    first["baseline"] = point(0, None)
    first["latest"] = point(0, None)
    first["best"] = None
    lines = render(eval_table(answer))
    row = next(line for line in lines if line.startswith("continued_pretrain"))
    assert row.split()[-4:] == ["-", "-", "-", "-"]


def run(i: int, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": f"run_{i:012x}",
        "name": name,
        "status": "running",
        "phase": "sft_instruction_following",
        "step": 1234,
        "total_steps": 12000,
        "restarts": 1,
        "preemptions": 2,
        "tags": ["lr-sweep", "replay-every-phase", "baseline"],
        "created_at": "2026-05-01T12:34:56.789+00:00",
        **extra,
    }


def test_runs_list_fits_80_columns_keeping_ids_and_steps_whole() -> None:
    runs = [
        run(1, "sft original, replay phases, carry optimizer state everywhere"),
        run(2, "mixture replay", status="recovering", waiting_for_worker=True, queue_position=1),
        run(3, "r"),
    ]
    lines = render(runs_table(runs))
    assert_fits_with_numbers_whole(lines, [r["id"] for r in runs] + ["1234/12000"], WIDTH)
    assert header(lines, "id")[:2] == ["id", "name"]
    # Wide enough, every column is there.
    wide = render(runs_table(runs), 250)
    assert header(wide, "id") == [
        "id",
        "name",
        "status",
        "phase",
        "step",
        "prio",
        "queue",
        "restarts",
        "tags",
        "created",
    ]
    assert "lr-sweep, replay-every-phase, baseline" in "\n".join(wide)


def comparison(runs: int = 3) -> dict[str, Any]:
    names = ["replay phases (reference)", "mixture replay 25%", "carry everywhere"][:runs]
    return {
        "runs": [
            {
                "id": f"run_{i:012x}",
                "name": name,
                "status": "succeeded",
                "step": 257,
                "total_steps": 257,
                "tags": ["sft-original"],
                "signature": f"{i}" * 64,
            }
            for i, name in enumerate(names)
        ],
        "evals": [
            {
                "name": name,
                "task": task,
                "runs": [
                    {
                        "run_id": f"run_{i:012x}",
                        "baseline": point(0, 523.5),
                        "final": point(257, 2.66 + i),
                        "best": point(250, 2.6 + i),
                        "final_vs_first": None if i == 0 else 37.6 * i,
                        "best_vs_first": None,
                        "final_vs_baseline": -99.5,
                    }
                    for i in range(runs)
                ],
            }
            for name, task in SETS.items()
        ],
        "inputs": {
            "identical": True,
            "same_signature": True,
            "differences": [],
            "groups": [],
            "summary": "identical inputs",
        },
    }


def test_runs_compare_fits_80_columns_eval_table_first() -> None:
    answer = comparison()
    lines = render(comparison_view(answer))
    numbers = ["523.50", "2.66 @257", "4.66 @257", "2.60 @250", "-99.5%", "+37.6%", "+75.2%"]
    assert_fits_with_numbers_whole(lines, numbers, WIDTH)
    assert lines[0].strip().startswith("evaluation per eval set")
    text = "\n".join(lines)
    assert text.index("evaluation per eval set") < text.index("runs (the first")
    assert all(r["id"] in text for r in answer["runs"])
    assert header(render(evals_table(answer), 200), "set")[:3] == ["set", "task", "run"]


def by_phase_answer() -> dict[str, Any]:
    phases = ["pretrain", "sft_summarization", "replay_0", "sft_instruction_following"]
    ppl = {0: 512.0, 1: 5.0, 2: 9.5, 3: 4.0, 4: 6.25}
    sets = [
        {"name": name, "task": task, "baseline": point(0, 512.0)} for name, task in SETS.items()
    ]
    return {
        "run_id": "run_0123456789ab",
        "sets": sets,
        "phases": [
            {
                "index": i,
                "name": name,
                "objective": "continued_pretrain" if "sft" not in name else "summarization",
                "role": "replay" if name.startswith("replay") else "train",
                "first_step": 25 * i + 1,
                "last_step": 25 * i + 25,
                "sets": [
                    {
                        "start": point(25 * i, ppl[i]),
                        "end": point(25 * i + (25 if i < 3 else 10), ppl[i + 1]),
                        "complete": i < 3,
                        "change": 100 * (ppl[i + 1] / ppl[i] - 1),
                    }
                    for _ in sets
                ],
            }
            for i, name in enumerate(phases)
        ],
    }


def test_by_phase_matrix_fits_80_columns_splitting_sets_rather_than_cutting() -> None:
    lines = render(phase_matrix(by_phase_answer()))
    numbers = ["512.00", "5.00", "-99%", "9.50", "+90%", "4.00", "-58%", "6.25", "+56%*"]
    assert_fits_with_numbers_whole(lines, numbers, WIDTH)
    text = "\n".join(lines)
    for name in SETS:  # headers wrap after "_" or "-"
        assert all(piece in text for piece in re.split(r"[_-]", name)), name
    assert "replay_0 (replay)" in text
    assert "* so far" in text
    # Every part of a split matrix names the phases.
    parts = [line for line in lines if line.startswith("phase")]
    assert len(parts) >= 1 and sum("sft_summarization" in line for line in lines) == len(parts)


@pytest.mark.parametrize(
    ("change", "style", "shown"),
    [(60.0, "red", "8.00 +60%"), (-92.0, "green", "8.00 -92%"), (0.4, "red", "8.00 +0.4%")],
)
def test_a_matrix_cell_is_red_when_perplexity_rose_and_green_when_it_fell(
    change: float, style: str, shown: str
) -> None:
    cell = matrix_cell(
        {"start": point(0, 5.0), "end": point(10, 8.0), "complete": True, "change": change}
    )
    assert cell.plain == shown
    assert [span.style for span in cell.spans] == [style]


def test_the_demo_loss_table_fits_80_columns() -> None:
    losses = [("sft_retrieval_planning_with_a_very_long_phase_name", 6.1234, 1.5678)]
    lines = render(loss_table(losses))
    assert_fits_with_numbers_whole(lines, ["6.123", "1.568"], WIDTH)
