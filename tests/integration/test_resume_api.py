"""`POST /runs/{id}/resume` and initial checkpoints taken from another run, on real Postgres
and Redis, with the worker protocol driven over HTTP as a worker drives it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import func, select
from test_api import (
    Worker,
    assert_error,
    current_attempt,
    get_run,
    message_args,
    ping_worker,
    queued_messages,
    submit,
)
from weights import write_model_dir, write_weights_file

from contracts.api import RunResume
from contracts.signature import sha256_file, sha256_path
from service.errors import ApiError
from service.models import Attempt, OutboxMessage, Run
from service.runs.resume import resume_run

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings())


def resume(api: Api, run_id: str, body: dict[str, Any] | None = None) -> Any:
    """POST /runs/{id}/resume; no body at all when `body` is None (the id alone)."""
    if body is None:
        return api.client.post(f"/runs/{run_id}/resume", headers=api.admin)
    return api.client.post(f"/runs/{run_id}/resume", json=body, headers=api.admin)


def write_weights(api: Api, name: str, content: bytes) -> Path:
    """Safetensors weights of the tiny model at `name` under the data root, `content` in
    their metadata (the service checks what a checkpoint is)."""
    return write_weights_file(api.settings.data_root / name, content.decode())


def seeded_run(api: Api, doc: dict[str, Any], checkpoint: str = "base.safetensors") -> Any:
    """A run started from the initial checkpoint `checkpoint` (relative to the data root)."""
    response = submit(api, {"workflow": doc, "initial_checkpoint": checkpoint})
    assert response.status_code == 201, response.text
    return response.json()


def fail_run(api: Api, run: dict[str, Any], *, checkpoint_step: int | None = 6) -> Worker:
    """Claim the run's current attempt, register a checkpoint in phase 0, then fail it."""
    worker = Worker(api, current_attempt(get_run(api, run["id"]))["id"])
    assert worker.claim().status_code == 200
    if checkpoint_step is not None:
        registered = worker.checkpoint(checkpoint_step, phase_index=0, phase_step=checkpoint_step)
        assert registered.status_code == 200, registered.text
    finished = worker.finish("failed", step=7, cause="oom", message="out of memory")
    assert finished.status_code == 200, finished.text
    assert get_run(api, run["id"])["status"] == "failed"
    return worker


def outbox_rows(api: Api) -> int:
    with api.sessions() as session:
        return session.scalar(select(func.count()).select_from(OutboxMessage)) or 0


def register_directory_checkpoint(worker: Worker, step: int, content: bytes) -> Path:
    """A checkpoint directory that exists (so it can be hashed), registered by `worker`."""
    path = write_model_dir(Path(worker.checkpoint_path(step)), content.decode())
    ref = {"path": str(path), "step": step, "phase_index": 0, "phase_step": step}
    response = worker.post("checkpoints", {"fencing_token": worker.token, "checkpoint": ref})
    assert response.status_code == 200, response.text
    return path


# --- resuming -----------------------------------------------------------------------------


def test_run_from_an_initial_checkpoint_resumes_with_its_id_alone_inside_a_phase(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    weights = write_weights(api, "base.safetensors", b"pretrained weights")
    ping_worker(api)  # the service places each attempt on it (its message goes there)
    run = seeded_run(api, tiny_workflow(phases=2, steps=10))
    first = Worker(api, run["attempts"][0]["id"])
    first.claim()
    first.checkpoint(step=10, phase_index=0, phase_step=10)
    first.finish("succeeded", step=10)
    # Phase 1 checkpoints at its step 4 (global 14), then its worker fails.
    second = Worker(api, current_attempt(get_run(api, run["id"]))["id"])
    second.claim()
    second.checkpoint(step=14, phase_index=1, phase_step=4)
    second.finish("failed", step=15, cause="oom", message="CUDA out of memory")
    failed = get_run(api, run["id"])
    assert (failed["status"], failed["cause"]) == ("failed", "oom")

    response = resume(api, run["id"])
    assert response.status_code == 200, response.text
    resumed = response.json()
    assert resumed["id"] == run["id"]
    assert resumed["signature"] == run["signature"]
    assert (resumed["status"], resumed["cause"], resumed["message"]) == ("recovering", None, None)
    assert resumed["finished_at"] is None
    assert [(a["number"], a["phase_index"], a["status"]) for a in resumed["attempts"]] == [
        (1, 0, "succeeded"),
        (2, 1, "failed"),
        (3, 1, "queued"),
    ]
    new_id = resumed["attempts"][2]["id"]
    # Committed, then sent: the new attempt's message is on the queue.
    assert new_id in [message_args(m)[0] for m in queued_messages(api.settings)]

    third = Worker(api, new_id)
    claimed = third.claim()
    assert claimed.status_code == 200, claimed.text
    claim = claimed.json()
    assert claim["attempt_number"] == 3
    assert claim["phase_index"] == 1
    assert claim["resume_from"] == {
        "path": f"{claim['artifact_dir']}/checkpoints/step-00000014",
        "step": 14,
        "phase_index": 1,
        "phase_step": 4,
    }
    # Identity only: the weights come from resume_from; the digest is the stored one.
    assert claim["initial_checkpoint"] == str(weights)
    assert claim["digests"]["initial_checkpoint"] == sha256_file(weights)
    assert claim["signature"] == run["signature"]
    assert third.checkpoint(step=20, phase_index=1, phase_step=10).status_code == 200
    assert third.finish("succeeded", step=20).status_code == 200
    assert get_run(api, run["id"])["status"] == "succeeded"


def test_mismatch_names_every_differing_field_with_both_values(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    base = write_weights(api, "base.safetensors", b"pretrained weights")
    other = write_weights(api, "other.safetensors", b"other weights")
    doc = tiny_workflow(phases=2, steps=10)
    run = seeded_run(api, doc)
    fail_run(api, run)

    changed = tiny_workflow(phases=2, steps=10)
    changed["phases"][1]["steps"] = 7
    response = resume(
        api, run["id"], {"workflow": changed, "initial_checkpoint": "other.safetensors"}
    )
    error = assert_error(response, 409, "signature_mismatch")
    stored, given = sha256_file(base), sha256_file(other)
    assert error["details"] == {
        "differences": [
            {"field": "initial_checkpoint.sha256", "stored": stored, "given": given},
            {"field": "phases[1].steps", "stored": 10, "given": 7},
        ]
    }
    assert f"initial_checkpoint.sha256 stored {stored} given {given}" in error["message"]
    assert "phases[1].steps stored 10 given 7" in error["message"]
    # Refused: nothing changed.
    after = get_run(api, run["id"])
    assert after["status"] == "failed"
    assert len(after["attempts"]) == 1


def test_a_changed_data_file_is_named(api: Api, tiny_workflow: WorkflowFactory) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    fail_run(api, run)
    data = api.settings.data_root / "pretrain.jsonl"
    before = sha256_file(data)
    data.write_text('{"text": "the corpus was edited after the run started"}\n')

    error = assert_error(resume(api, run["id"]), 409, "signature_mismatch")
    field = f'data["{data}"].sha256'
    assert error["details"]["differences"] == [
        {"field": field, "stored": before, "given": sha256_file(data)}
    ]
    assert f"{field} stored {before} given {sha256_file(data)}" in error["message"]


def test_a_different_initial_checkpoint_is_refused_naming_both_digests(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    base = write_weights(api, "base.safetensors", b"pretrained weights")
    run = seeded_run(api, tiny_workflow(phases=1))
    fail_run(api, run)
    # The same path, other content: its digest is what counts.
    write_weights(api, "base.safetensors", b"retrained weights!")

    error = assert_error(
        resume(api, run["id"], {"initial_checkpoint": str(base)}), 409, "signature_mismatch"
    )
    [difference] = error["details"]["differences"]
    assert difference["field"] == "initial_checkpoint.sha256"
    assert difference["given"] == sha256_file(base)
    assert difference["stored"] != difference["given"]
    assert difference["stored"] in error["message"]
    assert difference["given"] in error["message"]
    assert len(get_run(api, run["id"])["attempts"]) == 1


def test_the_same_initial_checkpoint_moved_elsewhere_is_accepted(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    base = write_weights(api, "base.safetensors", b"pretrained weights")
    run = seeded_run(api, tiny_workflow(phases=1))
    fail_run(api, run)
    moved = api.settings.data_root / "archive" / "base-v1.safetensors"
    moved.parent.mkdir()
    base.rename(moved)

    response = resume(api, run["id"], {"initial_checkpoint": "archive/base-v1.safetensors"})
    assert response.status_code == 200, response.text
    resumed = response.json()
    assert resumed["signature"] == run["signature"]
    assert resumed["status"] == "recovering"
    # Workers verify the file where it lies now.
    assert resumed["initial_checkpoint"] == str(moved)
    claim = Worker(api, current_attempt(resumed)["id"]).claim().json()
    assert claim["initial_checkpoint"] == str(moved)
    assert claim["digests"]["initial_checkpoint"] == sha256_file(moved)
    assert claim["resume_from"]["step"] == 6


def test_resuming_a_succeeded_run_takes_no_step(api: Api, tiny_workflow: WorkflowFactory) -> None:
    ping_worker(api)
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    worker = Worker(api, run["attempts"][0]["id"])
    worker.claim()
    worker.checkpoint(step=10, phase_index=0, phase_step=10)
    worker.finish("succeeded", step=10)
    done = get_run(api, run["id"])

    response = resume(api, run["id"])
    assert response.status_code == 200, response.text
    assert response.json() == done
    assert outbox_rows(api) == 1


def test_an_active_run_is_refused(api: Api, tiny_workflow: WorkflowFactory) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    queued = assert_error(resume(api, run["id"]), 409, "run_active")
    assert queued["details"]["attempt_status"] == "queued"

    worker = Worker(api, run["attempts"][0]["id"])
    worker.claim()
    running = assert_error(resume(api, run["id"]), 409, "run_active")
    assert running["details"]["attempt_status"] == "running"
    assert "gpu-1" in running["message"]
    # The owner is unaffected.
    assert worker.heartbeat(step=2).json()["action"] == "continue"
    assert len(get_run(api, run["id"])["attempts"]) == 1


def test_an_expired_lease_makes_the_attempt_lost_and_the_resume_proceeds(
    make_settings: SettingsFactory, make_api: ApiFactory, tiny_workflow: WorkflowFactory
) -> None:
    api = make_api(make_settings(lease_seconds=0.5, reaper_interval_seconds=3600))
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    # A worker that registered a checkpoint, then was SIGKILLed: no report renews its lease.
    dead = Worker(api, run["attempts"][0]["id"])
    dead.claim()
    dead.checkpoint(step=3, phase_index=0, phase_step=3)
    time.sleep(0.8)

    response = resume(api, run["id"])
    assert response.status_code == 200, response.text
    resumed = response.json()
    lost, retry = resumed["attempts"]
    assert lost["status"] == "lost"
    assert "lease expired" in lost["message"]
    assert (retry["number"], retry["status"]) == (2, "queued")
    assert resumed["status"] == "recovering"
    # Should the lost worker come back, it is told to stop and cannot write.
    assert dead.heartbeat(step=4).json()["action"] == "stop"
    assert_error(dead.metrics([("loss", 4, 1.0)]), 409, "superseded")
    claim = Worker(api, retry["id"]).claim().json()
    assert claim["resume_from"]["step"] == 3


def test_concurrent_resumes_create_exactly_one_attempt(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    fail_run(api, run)
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def attempt_resume() -> None:
        barrier.wait()
        with api.sessions() as session:
            try:
                resume_run(
                    session=session,
                    run_id=run["id"],
                    request=RunResume(),
                    data_root=api.settings.data_root,
                )
                outcomes.append("resumed")
            except ApiError as err:
                outcomes.append(err.code)

    threads = [threading.Thread(target=attempt_resume) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["resumed"] + ["run_active"] * 5
    with api.sessions() as session:
        numbers = session.scalars(select(Attempt.number).where(Attempt.run_id == run["id"]))
        assert sorted(numbers) == [1, 2]


# --- initial checkpoints from another run -------------------------------------------------


def test_initial_checkpoint_from_another_run_resolves_to_its_registered_checkpoint(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow(phases=1)
    source = submit(api, {"workflow": doc, "name": "pretrain"}).json()
    worker = Worker(api, source["attempts"][0]["id"])
    worker.claim()
    five = register_directory_checkpoint(worker, 5, b"weights at step 5")
    register_directory_checkpoint(worker, 10, b"weights at step 10")

    response = submit(
        api, {"workflow": doc, "initial_checkpoint": {"run": source["id"], "step": 5}}
    )
    assert response.status_code == 201, response.text
    tuned = response.json()
    assert tuned["initial_checkpoint"] == str(five)
    with api.sessions() as session:
        stored = session.get(Run, tuned["id"])
        assert stored is not None
        assert stored.signature_components["initial_checkpoint"] == {
            "path": str(five),
            "sha256": sha256_path(five),
            "run": source["id"],
            "step": 5,
        }
    # Identity is content: the same directory given by its path signs the same.
    by_path = submit(api, {"workflow": doc, "initial_checkpoint": str(five)}).json()
    assert by_path["signature"] == tuned["signature"]

    missing = submit(api, {"workflow": doc, "initial_checkpoint": {"run": source["id"], "step": 7}})
    error = assert_error(missing, 422, "invalid_initial_checkpoint")
    assert source["id"] in error["message"]
    assert "step 7" in error["message"]
    assert "5, 10" in error["message"]
    assert error["details"] == {"run": source["id"], "step": 7, "available_steps": [5, 10]}
    unknown = submit(api, {"workflow": doc, "initial_checkpoint": {"run": "run_nope", "step": 5}})
    error = assert_error(unknown, 404, "run_not_found")
    assert error["message"].startswith("initial_checkpoint: run 'run_nope' does not exist")

    # Resume: the same reference is accepted; another step's weights are refused by name.
    fail_run(api, tuned, checkpoint_step=None)
    other = resume(api, tuned["id"], {"initial_checkpoint": {"run": source["id"], "step": 10}})
    [difference] = assert_error(other, 409, "signature_mismatch")["details"]["differences"]
    assert difference["field"] == "initial_checkpoint.sha256"
    same = resume(api, tuned["id"], {"initial_checkpoint": {"run": source["id"], "step": 5}})
    assert same.status_code == 200, same.text
    assert same.json()["status"] == "recovering"
    missing_on_resume = resume(
        api, tuned["id"], {"initial_checkpoint": {"run": source["id"], "step": 7}}
    )
    assert_error(missing_on_resume, 422, "invalid_initial_checkpoint")


def test_resuming_an_unknown_run_is_404(api: Api) -> None:
    assert_error(resume(api, "run_missing"), 404, "run_not_found")
