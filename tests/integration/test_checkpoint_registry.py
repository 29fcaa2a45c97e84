"""The checkpoint registry follows the disk, driven over HTTP as a worker drives it: what a
worker deletes or quarantines is reported, shown with why, and never handed out again; a
checkpoint another run starts from is pinned until that run succeeded or has a checkpoint of its
own."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_leases import Claimant, error_code, second_worker_headers, start_run
from weights import write_model_dir

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
    """The app on Postgres, and on the embedded SQLite (pins are read from JSON columns)."""
    if request.param == "postgres":
        return make_api(make_settings(reaper_interval_seconds=3600))
    url = f"sqlite:///{tmp_path / 'trainctl.db'}"
    upgrade_database(url)
    return make_api(make_settings(database_url=url, reaper_interval_seconds=3600))


def claimed(api: Api, attempt_id: str, nonce: str = "n") -> Claimant:
    worker = Claimant(api, attempt_id, api.worker, nonce=nonce)
    answer = worker.claim()
    assert answer.status_code == 200, answer.text
    return worker


def register(worker: Claimant, step: int) -> dict[str, Any]:
    """A checkpoint directory on disk (another run may hash it), registered; the answer."""
    path = Path(worker.claimed["artifact_dir"]) / "checkpoints" / f"step-{step:08d}"
    write_model_dir(path, f"weights at step {step}")
    answer = worker.checkpoint(step)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def report_removal(worker: Claimant, step: int, status: str, reason: str = "retention") -> Any:
    body = {"fencing_token": worker.secret, "step": step, "status": status, "reason": reason}
    return worker.post("checkpoints/removals", body)


def listed(api: Api, run_id: str, status: str | None = None) -> list[dict[str, Any]]:
    params = {} if status is None else {"status": status}
    answer = api.client.get(f"/runs/{run_id}/checkpoints", params=params, headers=api.admin)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == len(body["checkpoints"])
    return list(body["checkpoints"])


def steps(checkpoints: list[dict[str, Any]]) -> list[int]:
    return [c["step"] for c in checkpoints]


def test_a_quarantined_checkpoint_is_shown_with_why_and_never_handed_out_again(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=10))
    first = claimed(api, attempt_id)
    register(first, 4)
    register(first, 8)
    why = "failed verification: optimizer.pt has SHA-256 0f.., the manifest says 9a.."
    answer = report_removal(first, 8, "quarantined", why)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"accepted": 1}

    assert steps(listed(api, run_id)) == [4]
    every = listed(api, run_id, "all")
    assert [(c["step"], c["status"], c["reason"]) for c in every] == [
        (4, "usable", None),
        (8, "quarantined", why),
    ]
    assert every[0]["removed_at"] is None and every[1]["removed_at"] is not None
    assert steps(listed(api, run_id, "quarantined")) == [8]
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    assert run["latest_checkpoint"]["step"] == 4

    # The worker is preempted; the next attempt resumes from 4, not from the quarantined 8.
    assert first.finish("preempted", 8).status_code == 200
    run = api.client.get(f"/runs/{run_id}", headers=api.admin).json()
    second = claimed(api, run["attempts"][-1]["id"], nonce="m")
    assert second.claimed["resume_from"]["step"] == 4
    # Step 8 written anew is usable again.
    register(second, 8)
    assert [(c["step"], c["status"], c["reason"]) for c in listed(api, run_id, "all")] == [
        (4, "usable", None),
        (8, "usable", None),
    ]


def test_a_checkpoint_another_unfinished_run_starts_from_is_pinned(
    any_api: Api, tiny_workflow: WorkflowFactory
) -> None:
    api = any_api
    doc = tiny_workflow(phases=1, steps=20)
    source_id, attempt_id = start_run(api, doc)
    source = claimed(api, attempt_id)
    assert register(source, 4) == {"accepted": 1, "pinned_steps": []}
    created = api.client.post(
        "/runs",
        json={"workflow": doc, "initial_checkpoint": {"run": source_id, "step": 4}},
        headers=api.admin,
    )
    assert created.status_code == 201, created.text
    tuned = created.json()

    # Every registration's answer now says 4 is pinned, and a deletion of 4 is refused.
    assert register(source, 8) == {"accepted": 1, "pinned_steps": [4]}
    refused = report_removal(source, 4, "deleted")
    assert error_code(refused, 409) == "checkpoint_pinned"
    error = refused.json()["error"]
    assert tuned["id"] in error["message"]
    assert error["details"] == {"run_id": source_id, "step": 4, "pinned_by": [tuned["id"]]}
    assert steps(listed(api, source_id)) == [4, 8]
    # A quarantine is a fact about the files: recorded, pinned or not.
    quarantined = report_removal(source, 8, "quarantined", "failed verification: no manifest")
    assert quarantined.status_code == 200, quarantined.text

    # Once the run that needed it has a checkpoint of its own (its resumes load that), 4 may go.
    register(claimed(api, tuned["attempts"][0]["id"]), 2)
    assert register(source, 12) == {"accepted": 1, "pinned_steps": []}
    assert report_removal(source, 4, "deleted", "retention: keep_last 2").status_code == 200
    assert steps(listed(api, source_id)) == [12]
    assert steps(listed(api, source_id, "deleted")) == [4]

    # And nobody starts from it any more, told why.
    again = api.client.post(
        "/runs",
        json={"workflow": doc, "initial_checkpoint": {"run": source_id, "step": 4}},
        headers=api.admin,
    )
    assert error_code(again, 422) == "invalid_initial_checkpoint"
    error = again.json()["error"]
    assert "deleted (retention: keep_last 2)" in error["message"]
    assert error["details"] == {
        "run": source_id,
        "step": 4,
        "available_steps": [12],
        "status": "deleted",
        "reason": "retention: keep_last 2",
    }


def test_a_checkpoint_named_by_its_path_or_as_a_pretrained_model_is_pinned_as_well(
    any_api: Api, tiny_workflow: WorkflowFactory
) -> None:
    api = any_api
    doc = tiny_workflow(phases=1, steps=20)
    _, attempt_id = start_run(api, doc)
    source = claimed(api, attempt_id)
    register(source, 4)
    path = f"{source.claimed['artifact_dir']}/checkpoints/step-{4:08d}"
    pinning = []
    for body in (
        {"workflow": doc, "initial_checkpoint": path},
        {"workflow": {**doc, "model": {"pretrained": path}}},
    ):
        created = api.client.post("/runs", json=body, headers=api.admin)
        assert created.status_code == 201, created.text
        pinning.append(created.json())
    assert register(source, 8) == {"accepted": 1, "pinned_steps": [4]}
    refused = report_removal(source, 4, "deleted")
    assert error_code(refused, 409) == "checkpoint_pinned"
    pinned_by = refused.json()["error"]["details"]["pinned_by"]
    assert sorted(pinned_by) == sorted(run["id"] for run in pinning)

    # Each lets go once it has a checkpoint of its own.
    for run in pinning:
        register(claimed(api, run["attempts"][0]["id"]), 2)
    assert register(source, 12) == {"accepted": 1, "pinned_steps": []}
    assert report_removal(source, 4, "deleted").status_code == 200


@pytest.mark.parametrize("ended", ["failed", "cancelled"])
def test_a_run_that_may_be_resumed_keeps_its_pin_until_it_has_a_checkpoint_of_its_own(
    ended: str, any_api: Api, tiny_workflow: WorkflowFactory
) -> None:
    api = any_api
    doc = tiny_workflow(phases=1, steps=20)
    source_id, attempt_id = start_run(api, doc)
    source = claimed(api, attempt_id)
    register(source, 4)
    created = api.client.post(
        "/runs",
        json={"workflow": doc, "initial_checkpoint": {"run": source_id, "step": 4}},
        headers=api.admin,
    )
    assert created.status_code == 201, created.text
    tuned = created.json()

    # The run ends before it wrote a checkpoint of its own; a resume would start again from
    # step 4's weights, so 4 stays pinned.
    if ended == "failed":
        worker = claimed(api, tuned["attempts"][0]["id"])
        message = "data/pretrain.jsonl:1: not valid JSON"
        answer = worker.finish("failed", 0, cause="data", message=message)
    else:
        answer = api.client.post(f"/runs/{tuned['id']}/cancel", headers=api.admin)
    assert answer.status_code == 200, answer.text
    run = api.client.get(f"/runs/{tuned['id']}", headers=api.admin).json()
    assert run["status"] == ended
    assert register(source, 8) == {"accepted": 1, "pinned_steps": [4]}
    assert error_code(report_removal(source, 4, "deleted"), 409) == "checkpoint_pinned"

    # Resumed, it starts from 4 and writes a checkpoint of its own, which every later resume
    # starts from instead: 4 is no longer needed.
    resumed = api.client.post(f"/runs/{tuned['id']}/resume", json={}, headers=api.admin)
    assert resumed.status_code == 200, resumed.text
    again = claimed(api, resumed.json()["attempts"][-1]["id"], nonce="m")
    assert again.claimed["resume_from"] is None
    assert register(source, 12) == {"accepted": 1, "pinned_steps": [4]}
    register(again, 2)
    assert register(source, 16) == {"accepted": 1, "pinned_steps": []}
    assert report_removal(source, 4, "deleted", "retention: keep_last 2").status_code == 200
    assert steps(listed(api, source_id)) == [8, 12, 16]


def test_a_removal_report_is_fenced_and_bounded(api: Api, tiny_workflow: WorkflowFactory) -> None:
    run_id, attempt_id = start_run(api, tiny_workflow(phases=1, steps=10))
    worker = claimed(api, attempt_id)
    register(worker, 4)

    stranger = Claimant(api, attempt_id, second_worker_headers(api), nonce="x")
    stranger.secret = worker.secret
    assert error_code(report_removal(stranger, 4, "deleted"), 403) == "forbidden"
    stale = Claimant(api, attempt_id, api.worker, nonce="n")
    stale.secret = "not-the-claims-secret"
    assert error_code(report_removal(stale, 4, "deleted"), 409) == "superseded"
    assert error_code(report_removal(worker, 4, "renamed"), 422) == "invalid_request"
    assert error_code(report_removal(worker, 4, "deleted", "x" * 2001), 422) == "invalid_request"
    assert steps(listed(api, run_id)) == [4]

    # A step the registry never held (a dead attempt's leftover) changes nothing.
    assert report_removal(worker, 6, "deleted").json() == {"accepted": 0}
    assert steps(listed(api, run_id, "all")) == [4]
    # Reported twice (a spooled report sent again): the same answer.
    assert report_removal(worker, 4, "deleted").json() == {"accepted": 1}
    assert report_removal(worker, 4, "deleted").json() == {"accepted": 1}
    assert listed(api, run_id) == []
    bad = api.client.get(f"/runs/{run_id}/checkpoints?status=gone", headers=api.admin)
    assert error_code(bad, 422) == "invalid_request"
