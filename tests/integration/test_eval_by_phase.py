"""Forgetting, phase by phase (`GET /runs/{id}/eval/phases`), on real Postgres and on SQLite:
a four-phase run reported through the worker protocol over HTTP, each eval set read at each
phase's end against the phase's start."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from service.db import upgrade_database

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

# Perplexity of each set at each evaluated step. Phases (10 steps each): pretrain 1-10, then
# three supervised phases, 11-20, 21-30 (trained to step 25 so far) and 31-40 (not reached).
PERPLEXITY = {
    "pretrain": {0: 500.0, 5: 20.0, 10: 5.0, 15: 7.0, 20: 8.0, 25: 6.0},
    "summarization": {0: 400.0, 5: 90.0, 10: 50.0, 15: 6.0, 20: 4.0, 25: 4.5},
}


def report(api: Api, attempt_id: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.client.post(
        f"/internal/attempts/{attempt_id}/{action}", json=body, headers=api.worker
    )
    assert response.status_code == 200, f"{action}: {response.text}"
    return dict(response.json())


def evals_at(step: int, phase: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "task": "continued_pretrain" if name == "pretrain" else "summarization",
            "step": step,
            "phase": phase,
            "cross_entropy": math.log(values[step]),
            "perplexity": values[step],
            "records": 4,
            "target_tokens": 40,
            "oversized_records": 0,
        }
        for name, values in PERPLEXITY.items()
    ]


def train(api: Api, run_id: str, phase: int, steps: list[int], *, finish_at: int | None) -> None:
    """Claim the run's newest attempt (phase `phase`), report the evaluations at `steps` and
    finish at `finish_at` (None: the attempt goes on training)."""
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    attempt = max(run["attempts"], key=lambda a: a["number"])
    assert attempt["phase_index"] == phase, attempt
    claim = report(
        api, attempt["id"], "claim", {"hostname": "gpu", "pid": 1, "nonce": uuid.uuid4().hex}
    )
    fence = {"fencing_token": claim["fencing_token"]}
    for step in steps:
        report(api, attempt["id"], "evals", {**fence, "results": evals_at(step, f"phase{phase}")})
    if finish_at is None:
        report(api, attempt["id"], "heartbeat", {**fence, "step": steps[-1]})
        return
    path = f"{claim['artifact_dir']}/checkpoints/step-{finish_at:08d}"
    ref = {"path": path, "step": finish_at, "phase_index": phase, "phase_step": 10}
    report(api, attempt["id"], "checkpoints", {**fence, "checkpoint": ref})
    report(api, attempt["id"], "finish", {**fence, "status": "succeeded", "step": finish_at})


@pytest.mark.parametrize("database", ["postgres", "sqlite"])
def test_each_eval_set_at_each_phase_end_against_the_phase_start(
    database: str,
    tmp_path: Path,
    make_settings: SettingsFactory,
    make_api: ApiFactory,
    tiny_workflow: WorkflowFactory,
) -> None:
    overrides = {}
    if database == "sqlite":
        overrides["database_url"] = f"sqlite:///{tmp_path / 'trainctl.db'}"
        upgrade_database(overrides["database_url"])
    api = make_api(make_settings(**overrides))
    doc = tiny_workflow(phases=4, steps=10)
    doc["evals"].append(
        {"name": "pretrain", "task": "continued_pretrain", "data": "pretrain.jsonl"}
    )
    created = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    empty = api.client.get(f"/runs/{run_id}/eval/phases", headers=api.admin).json()
    assert empty["sets"] == [] and [p["name"] for p in empty["phases"]] == [
        f"phase{i}" for i in range(4)
    ]
    assert all(p["sets"] == [] for p in empty["phases"])

    train(api, run_id, 0, [0, 5, 10], finish_at=10)
    train(api, run_id, 1, [15, 20], finish_at=20)
    train(api, run_id, 2, [25], finish_at=None)

    answer = api.client.get(f"/runs/{run_id}/eval/phases", headers=api.admin)
    assert answer.status_code == 200, answer.text
    matrix = answer.json()
    assert matrix["run_id"] == run_id
    assert [(s["name"], s["task"]) for s in matrix["sets"]] == [
        ("pretrain", "continued_pretrain"),
        ("summarization", "summarization"),
    ]
    assert [s["baseline"]["perplexity"] for s in matrix["sets"]] == [500.0, 400.0]
    phases = matrix["phases"]
    assert [(p["index"], p["first_step"], p["last_step"]) for p in phases] == [
        (0, 1, 10),
        (1, 11, 20),
        (2, 21, 30),
        (3, 31, 40),
    ]
    assert [p["objective"] for p in phases] == ["continued_pretrain"] + ["summarization"] * 3

    def cell(phase: int, name: str) -> dict[str, Any]:
        index = [s["name"] for s in matrix["sets"]].index(name)
        return dict(phases[phase]["sets"][index])

    def steps(c: dict[str, Any]) -> tuple[int | None, int | None]:
        return (
            None if c["start"] is None else c["start"]["step"],
            None if c["end"] is None else c["end"]["step"],
        )

    # Pretraining: from the baseline to its end, step 10.
    first = cell(0, "pretrain")
    assert steps(first) == (0, 10) and first["complete"] is True
    assert first["end"]["perplexity"] == pytest.approx(5.0)
    assert first["end"]["cross_entropy"] == pytest.approx(math.log(5.0))
    assert first["change"] == pytest.approx(100 * (5 / 500 - 1))
    # The supervised phase forgets pretraining (+60%) while its own set improves.
    forgot = cell(1, "pretrain")
    assert steps(forgot) == (10, 20) and forgot["complete"] is True
    assert forgot["change"] == pytest.approx(60.0)
    assert cell(1, "summarization")["change"] == pytest.approx(100 * (4 / 50 - 1))
    # The phase in training: its latest evaluation so far, not complete.
    training = cell(2, "pretrain")
    assert steps(training) == (20, 25) and training["complete"] is False
    assert training["change"] == pytest.approx(100 * (6 / 8 - 1))
    # The phase not reached: a start (the latest evaluation before it), no end, no change.
    pending = cell(3, "summarization")
    assert steps(pending) == (25, None)
    assert pending["complete"] is False and pending["change"] is None

    # A run that does not exist is 404 in the error shape.
    missing = api.client.get("/runs/run_doesnotexist/eval/phases", headers=api.admin)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "run_not_found"
