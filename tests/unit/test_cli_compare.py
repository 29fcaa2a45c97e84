"""`trainctl runs compare` output: pure functions of the API's comparison answer."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from cli.compare import comparison_view, inputs_view

SHA_A, SHA_B = "a" * 64, "b" * 64


def answer(differences: list[dict[str, Any]]) -> dict[str, Any]:
    runs = [
        {
            "id": f"run_{i}",
            "name": name,
            "status": "succeeded",
            "step": 10,
            "total_steps": 10,
            "tags": ["sweep"] if i else [],
            "signature": f"{i}" * 64,
        }
        for i, name in enumerate(("ref", "lower-lr"))
    ]
    point = {"step": 10, "cross_entropy": 1.0, "perplexity": 2.718}
    return {
        "runs": runs,
        "evals": [
            {
                "name": "qa-rag",
                "task": "qa_reasoning",
                "runs": [
                    {
                        "run_id": run["id"],
                        "baseline": {**point, "step": 0, "perplexity": 30.0},
                        "final": point,
                        "best": point,
                        "final_vs_first": None if i == 0 else 12.5,
                        "best_vs_first": None if i == 0 else 12.5,
                        "final_vs_baseline": -90.9,
                    }
                    for i, run in enumerate(runs)
                ],
            }
        ],
        "inputs": {
            "identical": not differences,
            "same_signature": not differences,
            "differences": differences,
            "summary": "identical inputs: the 2 runs signed the same workflow"
            if not differences
            else f"{len(differences)} input field(s) differ",
        },
    }


def render(renderable: Any) -> str:
    console = Console(width=120, record=True, color_system=None)
    console.print(renderable, soft_wrap=True)
    return console.export_text()


def test_each_differing_field_lists_every_runs_value_whole() -> None:
    text = render(
        comparison_view(
            answer(
                [
                    {"field": "optimizer.adamw_lr", "values": [0.003, 0.001]},
                    {"field": 'data["/d/a.jsonl"].sha256', "values": [SHA_A, SHA_B]},
                    {"field": 'data["/d/new.jsonl"].sha256', "values": [None, SHA_B]},
                ]
            )
        )
    )
    lines = [line.strip() for line in text.splitlines()]
    assert "optimizer.adamw_lr" in lines
    assert "1:ref       0.003" in lines and "2:lower-lr  0.001" in lines
    assert f"1:ref       {SHA_A}" in lines and f"2:lower-lr  {SHA_B}" in lines
    assert "1:ref       (none)" in lines
    assert "qa-rag" in text and "+12.5%" in text and "-90.9%" in text and "ref" in text


def test_identical_inputs_say_so() -> None:
    text = render(inputs_view(answer([])))
    assert text.startswith("what differs: nothing. identical inputs")


def grouped(differences: list[dict[str, Any]]) -> dict[str, Any]:
    """`answer` with each difference's group and the groups' headings, as the service
    answers them (service.reads.compare.input_groups)."""
    found = answer(differences)
    titles = {"data": "data files", "phases": "per-phase fields", "optimizer": "optimizer"}
    found["inputs"]["groups"] = [
        {"name": name, "title": title, "count": n, "summary": f"{n} fields"}
        for name, title in titles.items()
        if (n := sum(d["group"] == name for d in differences))
    ]
    return found


def test_a_long_group_shows_its_first_fields_and_how_many_more_and_all_shows_every_one() -> None:
    phases = [
        {"field": f"phases[{i}].steps", "values": [10, 20], "group": "phases"} for i in range(8)
    ]
    lr = {"field": "optimizer.adamw_lr", "values": [0.003, 0.001], "group": "optimizer"}
    view = grouped([*phases, lr])
    folded = render(comparison_view(view))
    assert [f"phases[{i}].steps" in folded for i in range(8)] == [True] * 5 + [False] * 3
    assert "... and 3 more (--all shows every one)" in folded
    assert folded.index("per-phase fields: 8 fields") < folded.index("optimizer: 1 field")
    assert "optimizer.adamw_lr" in folded  # a short group is shown whole
    every = render(comparison_view(view, fold_after=None))
    assert all(f"phases[{i}].steps" in every for i in range(8)) and "more" not in every


def test_at_80_columns_a_digest_is_whole_and_the_run_names_beside_it_are_cut() -> None:
    view = grouped(
        [{"field": 'data["/d/a.jsonl"].sha256', "values": [SHA_A, SHA_B], "group": "data"}]
    )
    view["runs"][1]["name"] = "mixture replay with a lower learning rate"
    console = Console(width=80, record=True, color_system=None)
    console.print(comparison_view(view))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    values = [line.split() for line in lines if SHA_A in line or SHA_B in line]
    assert values == [["1:ref", SHA_A], ["2:mixture…", SHA_B]]
