"""Best checkpoints, driven over HTTP as a worker and a user drive them (pins on Postgres
and SQLite): `checkpoint.keep_best` pins each named set's best checkpoint (a deletion report of
it is refused), the checkpoints' answer says when a set's best evaluation has no checkpoint,
and `{"run", "best": SET}` names one as another run's initial checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_checkpoint_registry import claimed, register, report_removal
from test_leases import Claimant, error_code, start_run

from service.auth import create_token
from service.checkpoints.registry import pins
from service.db import upgrade_database

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings(reaper_interval_seconds=3600))


@pytest.fixture(params=["postgres", "sqlite"])
def any_api(
    request: pytest.FixtureRequest,
    make_settings: SettingsFactory,
    make_api: ApiFactory,
    tmp_path: Path,
) -> Api:
    """The app on Postgres, and on the embedded SQLite."""
    if request.param == "postgres":
        return make_api(make_settings(reaper_interval_seconds=3600))
    url = f"sqlite:///{tmp_path / 'trainctl.db'}"
    upgrade_database(url)
    return make_api(make_settings(database_url=url, reaper_interval_seconds=3600))


def keeping_best(tiny_workflow: WorkflowFactory) -> dict[str, Any]:
    """20 steps, a checkpoint every 5, two newest kept; two eval sets on one file, the best of
    `summarization` kept and of `other` not."""
    doc = tiny_workflow(phases=1, steps=20)
    summaries = doc["evals"][0]
    doc["evals"] = [summaries, {**summaries, "name": "other"}]
    doc["checkpoint"] = {"every_steps": 5, "keep_last": 2, "keep_best": ["summarization"]}
    return doc


def evaluate(worker: Claimant, step: int, **cross_entropy: float) -> None:
    results = [
        {
            "name": name,
            "task": "summarization",
            "step": step,
            "phase": "phase0",
            "cross_entropy": ce,
            "perplexity": 2.0**ce,
            "records": 1,
            "target_tokens": 3,
        }
        for name, ce in cross_entropy.items()
    ]
    answer = worker.post("evals", {"fencing_token": worker.secret, "results": results})
    assert answer.status_code == 200, answer.text


def best_of(api: Api, run_id: str) -> dict[str, dict[str, Any]]:
    answer = api.client.get(f"/runs/{run_id}/checkpoints", headers=api.admin)
    assert answer.status_code == 200, answer.text
    return {b["name"]: b for b in answer.json()["best"]}


def test_keep_best_pins_each_sets_best_checkpoint_until_a_better_one_is_registered(
    any_api: Api, tiny_workflow: WorkflowFactory
) -> None:
    api = any_api
    run_id, attempt_id = start_run(api, keeping_best(tiny_workflow))
    worker = claimed(api, attempt_id)
    evaluate(worker, 0, summarization=3.0, other=3.0)
    evaluate(worker, 5, summarization=2.0, other=2.9)
    assert register(worker, 5)["pinned_steps"] == [5]
    evaluate(worker, 10, summarization=2.5, other=1.0)  # `other`'s best: not kept
    assert register(worker, 10)["pinned_steps"] == [5]

    refused = report_removal(worker, 5, "deleted")
    assert error_code(refused, 409) == "checkpoint_pinned"
    error = refused.json()["error"]
    assert "best checkpoint of eval set(s) 'summarization'" in error["message"]
    assert "checkpoint.keep_best" in error["message"]
    assert error["details"] == {"run_id": run_id, "step": 5, "best_of": ["summarization"]}
    # `other` is not kept: its best checkpoint goes like any other.
    assert report_removal(worker, 10, "deleted").status_code == 200

    # A better evaluation at a checkpoint step moves the pin; the old best may go.
    evaluate(worker, 15, summarization=1.5, other=2.0)
    assert register(worker, 15)["pinned_steps"] == [15]
    assert report_removal(worker, 5, "deleted").status_code == 200

    # The best evaluation at a step without a checkpoint is no best checkpoint, and is said so.
    evaluate(worker, 17, summarization=1.2, other=3.0)
    best = best_of(api, run_id)
    kept = best["summarization"]
    assert (kept["kept"], kept["step"], kept["best_eval_step"]) == (True, 15, 17)
    assert kept["cross_entropy"] == 1.5 and kept["best_eval_cross_entropy"] == 1.2
    assert "step 17" in kept["note"] and "the best checkpoint is step 15's" in kept["note"]
    # `other`'s best step lost its checkpoint: the best of what is left is step 15's.
    other = best["other"]
    assert (other["kept"], other["step"], other["best_eval_step"]) == (False, 15, 10)


def test_a_run_starts_from_another_runs_best_checkpoint_of_a_set(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = keeping_best(tiny_workflow)
    source_id, attempt_id = start_run(api, doc)
    worker = claimed(api, attempt_id)
    evaluate(worker, 0, summarization=3.0)
    evaluate(worker, 5, summarization=2.0)
    register(worker, 5)
    evaluate(worker, 10, summarization=2.5, other=2.0)
    register(worker, 10)
    evaluate(worker, 12, other=1.0)  # `other` scored at steps 10 and 12 only

    created = api.client.post(
        "/runs",
        json={"workflow": doc, "initial_checkpoint": {"run": source_id, "best": "summarization"}},
        headers=api.admin,
    )
    assert created.status_code == 201, created.text
    tuned = created.json()
    # Resolved at creation to the step, shown with the set it came from, and signed by the
    # content of that step's checkpoint like any other.
    assert tuned["initial_checkpoint_from"] == {
        "run": source_id,
        "step": 5,
        "best": "summarization",
    }
    assert tuned["initial_checkpoint"].endswith("/checkpoints/step-00000005")
    by_step = api.client.post(
        "/runs",
        json={"workflow": doc, "initial_checkpoint": {"run": source_id, "step": 5}},
        headers=api.admin,
    ).json()
    assert by_step["signature"] == tuned["signature"]
    assert by_step["initial_checkpoint_from"] == {"run": source_id, "step": 5, "best": None}
    # Pinned as {"run", "step"} is: the source's retention keeps step 5 for the new run.
    with api.sessions() as session:
        assert sorted(pins(session=session, run_id=source_id)[5]) == sorted(
            [tuned["id"], by_step["id"]]
        )

    # A resume keeps where it came from.
    assert api.client.post(f"/runs/{tuned['id']}/cancel", headers=api.admin).status_code == 200
    resumed = api.client.post(f"/runs/{tuned['id']}/resume", json={}, headers=api.admin)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["initial_checkpoint_from"]["best"] == "summarization"

    def refused(given: dict[str, Any], status: int, headers: dict[str, str] = api.admin) -> Any:
        answer = api.client.post(
            "/runs", json={"workflow": doc, "initial_checkpoint": given}, headers=headers
        )
        error_code(answer, status)
        return answer.json()["error"]

    # A set the run never scored: named, with the sets it has.
    error = refused({"run": source_id, "best": "nope"}, 422)
    assert error["code"] == "invalid_initial_checkpoint"
    assert "no evaluation of eval set 'nope'" in error["message"]
    assert error["details"]["evaluated_sets"] == ["other", "summarization"]
    # A set scored only where no checkpoint is left: named, with both lists of steps.
    assert report_removal(worker, 10, "deleted").status_code == 200
    error = refused({"run": source_id, "best": "other"}, 422)
    assert "evaluated eval set 'other' at steps 10, 12, none of which" in error["message"]
    assert (error["details"]["evaluated_steps"], error["details"]["available_steps"]) == (
        [10, 12],
        [5],
    )

    # Another owner's run is as if it did not exist, and so is a run that does not.
    with api.sessions() as session:
        user = {"Authorization": f"Bearer {create_token(session=session, name='u', role='user')}"}
    for run in (source_id, "run_doesnotexist"):
        error = refused({"run": run, "best": "summarization"}, 404, user)
        assert error["code"] == "run_not_found" and error["details"]["run"] == run
    # One of step and best, never both or neither.
    for given in ({"run": source_id}, {"run": source_id, "step": 5, "best": "summarization"}):
        refused(given, 422)
