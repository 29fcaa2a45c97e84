"""Comparing runs and exporting their numbers: the pure parts (what differs in signed inputs,
the eval table's changes, CSV text, tag rules), over plain values."""

from __future__ import annotations

import copy
import csv
import io
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from contracts.api import RunUpdate
from contracts.signature import Digests, compute_signature
from contracts.workflow import Workflow
from service.reads.compare import eval_table, input_differences, input_groups, percent_change
from service.reads.export import EVAL_COLUMNS, METRIC_COLUMNS, csv_text

DOC: dict[str, Any] = {
    "name": "wf",
    "model": {"config": {"vocab_size": 64}},
    "tokenizer": "/t/tok.json",
    "microbatch_tokens": 64,
    "phases": [
        {
            "name": "pre",
            "objective": "continued_pretrain",
            "data": [{"path": "/d/a.jsonl"}],
            "sequence_length": 32,
            "microbatch_size": 2,
            "steps": 10,
        },
        {
            "name": "sft",
            "objective": "summarization",
            "data": [{"path": "/d/b.jsonl"}],
            "sequence_length": 32,
            "microbatch_size": 2,
            "steps": 4,
        },
    ],
}
DIGESTS = Digests(tokenizer="t" * 64, data={"/d/a.jsonl": "a" * 64, "/d/b.jsonl": "b" * 64})


def components(doc: dict[str, Any], digests: Digests = DIGESTS) -> dict[str, Any]:
    return compute_signature(workflow=Workflow.model_validate(doc), digests=digests).components


def test_identical_inputs_have_no_differences() -> None:
    assert input_differences([components(DOC), components(copy.deepcopy(DOC))]) == []


def test_a_learning_rate_and_a_data_file_are_named_with_each_runs_value() -> None:
    other = copy.deepcopy(DOC)
    other["optimizer"] = {"adamw_lr": 1e-3}
    changed = DIGESTS.model_copy(update={"data": {**DIGESTS.data, "/d/b.jsonl": "c" * 64}})
    found = {
        d.field: d.values for d in input_differences([components(DOC), components(other, changed)])
    }
    assert found == {
        "optimizer.adamw_lr": [3e-3, 1e-3],
        'data["/d/b.jsonl"].sha256': ["b" * 64, "c" * 64],
    }


def test_three_runs_each_field_against_the_first_with_every_runs_value() -> None:
    second = copy.deepcopy(DOC)
    second["phases"][0]["steps"] = 20
    third = copy.deepcopy(DOC)
    third["phases"][1]["steps"] = 8
    found = {
        d.field: d.values
        for d in input_differences([components(DOC), components(second), components(third)])
    }
    assert found == {"phases[0].steps": [10, 20, 10], "phases[1].steps": [4, 4, 8]}


def test_a_data_file_only_one_run_reads_is_none_for_the_other() -> None:
    other = copy.deepcopy(DOC)
    other["phases"][1]["data"] = [{"path": "/d/c.jsonl"}]
    digests = Digests(tokenizer="t" * 64, data={"/d/a.jsonl": "a" * 64, "/d/c.jsonl": "c" * 64})
    found = {
        d.field: d.values for d in input_differences([components(DOC), components(other, digests)])
    }
    assert found['data["/d/b.jsonl"].sha256'] == ["b" * 64, None]
    assert found['data["/d/c.jsonl"].sha256'] == [None, "c" * 64]
    assert found["phases[1].data[0].path"] == ["/d/b.jsonl", "/d/c.jsonl"]


def test_differences_are_grouped_data_files_by_what_happened_then_each_kind_of_field() -> None:
    other = copy.deepcopy(DOC)
    other["phases"][1]["data"] = [{"path": "/d/c.jsonl"}]  # b.jsonl out, c.jsonl in
    other["phases"][1]["steps"] = 8
    other["optimizer"] = {"adamw_lr": 1e-3}
    other["seed"] = 7
    other["evals"] = [{"task": "summarization", "data": "/d/b.jsonl"}]
    digests = Digests(tokenizer="u" * 64, data={"/d/a.jsonl": "z" * 64, "/d/c.jsonl": "c" * 64})
    found = input_differences([components(DOC), components(other, digests)])
    groups = [(d.group, d.field, d.changes) for d in found]
    assert [g for g, _, _ in groups] == sorted(
        (g for g, _, _ in groups), key=["data", "phases", "optimizer", "evals", "other"].index
    )
    by_field = {field: (group, changes) for group, field, changes in groups}
    assert by_field['data["/d/a.jsonl"].sha256'] == ("data", [None, "changed"])
    assert by_field['data["/d/b.jsonl"].sha256'] == ("data", [None, "removed"])
    assert by_field['data["/d/c.jsonl"].sha256'] == ("data", [None, "added"])
    assert by_field["phases[1].steps"] == ("phases", [None, "changed"])
    assert by_field["phases[1].data[0].path"][0] == "phases"
    assert by_field["optimizer.adamw_lr"] == ("optimizer", [None, "changed"])
    assert by_field["evals[0].task"] == ("evals", [None, "added"])
    assert by_field["seed"][0] == by_field["tokenizer.sha256"][0] == "other"
    summaries = {g.name: (g.title, g.summary) for g in input_groups(found)}
    assert summaries["data"] == ("data files", "1 added, 1 removed, 1 changed")
    assert summaries["optimizer"] == ("optimizer", "1 field")
    assert list(summaries) == ["data", "phases", "optimizer", "evals", "other"]


def test_percent_change_is_none_without_both_values() -> None:
    assert percent_change(9.0, 10.0) == pytest.approx(-10.0)
    assert percent_change(None, 10.0) is None
    assert percent_change(9.0, None) is None
    assert percent_change(9.0, 0.0) is None


def row(run: str, name: str, step: int, ppl: float | None, latest: int, best: int) -> Any:
    return SimpleNamespace(
        run_id=run,
        name=name,
        task="qa_reasoning",
        step=step,
        cross_entropy=None if ppl is None else ppl / 10,
        perplexity=ppl,
        latest_rank=latest,
        best_rank=best,
    )


def test_eval_table_has_baseline_final_best_and_changes_against_the_first_run() -> None:
    rows = [
        row("a", "qa", 0, 40.0, 3, 3),
        row("a", "qa", 20, 10.0, 1, 2),
        row("a", "qa", 10, 8.0, 2, 1),
        row("b", "qa", 0, 40.0, 2, 2),
        row("b", "qa", 20, 12.0, 1, 1),
        row("b", "only-b", 20, 5.0, 1, 1),
    ]
    table = {s.name: s for s in eval_table(run_ids=["a", "b"], rows=rows)}
    assert list(table) == ["only-b", "qa"]
    first, second = table["qa"].runs
    assert (first.baseline.step, first.final.step, first.best.step) == (0, 20, 10)  # type: ignore[union-attr]
    assert first.final_vs_first is None
    assert first.final_vs_baseline == pytest.approx(-75.0)
    assert second.final_vs_first == pytest.approx(20.0)
    assert second.best_vs_first == pytest.approx(50.0)
    missing, present = table["only-b"].runs
    assert (missing.run_id, missing.final, missing.best) == ("a", None, None)
    assert present.final_vs_first is None  # the first run has no result to measure against


def test_csv_writes_none_as_an_empty_cell_and_floats_exactly() -> None:
    text = csv_text([METRIC_COLUMNS, ("run_1", "loss", 3, 0.1 + 0.2), ("run_1", "lr", 4, None)])
    rows = list(csv.reader(io.StringIO(text)))
    assert rows == [
        list(METRIC_COLUMNS),
        ["run_1", "loss", "3", repr(0.1 + 0.2)],
        ["run_1", "lr", "4", ""],
    ]
    assert float(rows[1][3]) == 0.1 + 0.2
    assert EVAL_COLUMNS[:4] == ("run_id", "name", "task", "step")


def test_tags_are_single_words_and_omitted_fields_are_not_set() -> None:
    update = RunUpdate.model_validate({"tags": ["baseline", "lr-sweep"]})
    assert update.model_fields_set == {"tags"}
    for bad in ("two words", "a,b", "", "x" * 65):
        with pytest.raises(ValidationError):
            RunUpdate.model_validate({"tags": [bad]})
    with pytest.raises(ValidationError):
        RunUpdate.model_validate({"tags": [f"t{i}" for i in range(33)]})
    with pytest.raises(ValidationError):
        RunUpdate.model_validate({"status": "succeeded"})
