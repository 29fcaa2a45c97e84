"""Downsampling and evaluation summaries: pure functions over plain values."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from service.reads.evaluation import summarize_evals
from service.reads.series import downsample, json_float, stride_indices


@pytest.mark.parametrize("n, max_points", [(10, 10), (10, 20), (0, 5), (3, None)])
def test_downsample_keeps_everything_that_fits(n: int, max_points: int | None) -> None:
    assert downsample(list(range(n)), max_points) == list(range(n))


@pytest.mark.parametrize("n, max_points", [(1000, 10), (1001, 10), (11, 10), (7, 2), (50, 3)])
def test_downsample_keeps_at_most_max_points_evenly_and_always_the_last(
    n: int, max_points: int
) -> None:
    kept = downsample(list(range(n)), max_points)
    assert len(kept) <= max_points
    assert kept[0] == 0
    assert kept[-1] == n - 1
    gaps = {b - a for a, b in itertools.pairwise(kept[:-1])}
    assert len(gaps) <= 1  # an even stride, except into the last point


def test_downsample_to_one_point_keeps_the_newest() -> None:
    assert downsample([1, 2, 3], 1) == [3]
    assert list(stride_indices(0, 1)) == []


def test_json_float_turns_non_finite_values_into_null() -> None:
    assert json_float(float("nan")) is None
    assert json_float(float("inf")) is None
    assert json_float(None) is None
    assert json_float(1.5) == 1.5


def point(task: str, step: int, ce: float | None, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or task,
        "task": task,
        "step": step,
        "phase": "p",
        "cross_entropy": ce,
        "perplexity": None,
        "records": 1,
        "target_tokens": 10,
        "oversized_records": 0,
    }


def test_eval_summary_names_baseline_latest_and_best_per_task() -> None:
    points = [point("qa", 10, 2.0), point("qa", 0, 4.0), point("qa", 5, 1.5), point("sum", 5, 3.0)]
    tasks = summarize_evals(points)
    qa = tasks["qa"]
    assert qa["baseline"]["step"] == 0
    assert qa["latest"]["step"] == 10
    assert qa["best"]["step"] == 5
    assert [p["step"] for p in qa["history"]] == [0, 5, 10]
    assert qa["task"] == "qa"
    assert "task" not in qa["latest"] and "name" not in qa["latest"]
    # No step-0 evaluation: no baseline, and the rest still works.
    assert tasks["sum"]["baseline"] is None
    assert tasks["sum"]["best"]["step"] == tasks["sum"]["latest"]["step"] == 5


def test_eval_summary_best_prefers_the_earliest_tie_and_skips_missing_losses() -> None:
    tasks = summarize_evals([point("qa", 0, 2.0), point("qa", 5, None), point("qa", 9, 2.0)])
    assert tasks["qa"]["best"]["step"] == 0
    assert tasks["qa"]["latest"]["step"] == 9


def test_eval_summary_downsamples_history_but_not_latest() -> None:
    points = [point("qa", step, 1.0 / (step + 1)) for step in range(0, 100)]
    qa = summarize_evals(points, max_points=5)["qa"]
    assert len(qa["history"]) <= 5
    assert qa["history"][-1]["step"] == 99
    assert qa["latest"]["step"] == 99


def test_eval_summary_keeps_two_sets_of_one_task_apart_by_name() -> None:
    points = [
        point("qa_reasoning", 0, 3.0, name="qa-mixture"),
        point("qa_reasoning", 0, 5.0, name="qa-rag"),
        point("qa_reasoning", 4, 2.0, name="qa-mixture"),
        point("qa_reasoning", 4, 4.0, name="qa-rag"),
    ]
    sets = summarize_evals(points)
    assert sorted(sets) == ["qa-mixture", "qa-rag"]
    assert {name: s["task"] for name, s in sets.items()} == {
        "qa-mixture": "qa_reasoning",
        "qa-rag": "qa_reasoning",
    }
    assert [p["cross_entropy"] for p in sets["qa-mixture"]["history"]] == [3.0, 2.0]
    assert [p["cross_entropy"] for p in sets["qa-rag"]["history"]] == [5.0, 4.0]
