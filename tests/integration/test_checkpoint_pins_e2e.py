"""The checkpoint registry and the disk, with real worker processes: retention in one run never
deletes the checkpoint another run still starts from, and a checkpoint a worker
quarantines is reported with why and never handed out again."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import workflow
from procs import Stack, processes, resume_when_lease_lapses, wait_for_run
from sqlalchemy import select
from test_resume_e2e import SERVICE_ENV, WORKER_ENV

from service.db import make_engine, make_session_factory
from service.models import Attempt, Checkpoint
from worker.checkpoint.layout import OPTIMIZER

pytestmark = pytest.mark.integration


def checkpoints(api: httpx.Client, run_id: str, status: str = "usable") -> list[dict[str, Any]]:
    answer = api.get(f"/runs/{run_id}/checkpoints", params={"status": status})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["checkpoints"])


def resumed_from_steps(database_url: str, run_id: str) -> list[int | None]:
    """The step of the checkpoint each attempt's claim named as `resume_from`, in order."""
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as session:
            attempts = session.scalars(
                select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)
            ).all()
            return [
                None
                if a.resume_checkpoint_id is None
                else session.get_one(Checkpoint, a.resume_checkpoint_id).step
                for a in attempts
            ]
    finally:
        engine.dispose()


def killed_after_checkpoint(
    stack: Stack, api: httpx.Client, body: dict[str, Any], step: int
) -> dict[str, Any]:
    """Submit `body` to a worker that SIGKILLs itself right after registering `step`."""
    doomed = stack.worker(
        **WORKER_ENV, TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS=f"after_checkpoint@{step}"
    )
    created = api.post("/runs", json=body)
    assert created.status_code == 201, created.text
    assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
    return dict(created.json())


def test_retention_in_one_run_cannot_break_a_run_that_starts_from_it(
    tmp_path: Path, postgres_url: str
) -> None:
    # Checkpoints every 4 steps, keep_last 2: registering 12 would delete 4.
    body = {"workflow": workflow("continued_pretrain", steps=12)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            source = killed_after_checkpoint(stack, api, body, 4)
            [four] = checkpoints(api, source["id"])
            assert four["step"] == 4
            # A run starts from the source's step 4, and waits (paused) until the source is
            # done: it claims its first attempt only after the source's retention ran.
            tuned_body = {
                "workflow": workflow("continued_pretrain", steps=4),
                "initial_checkpoint": {"run": source["id"], "step": 4},
            }
            created = api.post("/runs", json=tuned_body)
            assert created.status_code == 201, created.text
            tuned = created.json()
            assert api.post(f"/runs/{tuned['id']}/pause").json()["status"] == "paused"

            clean = stack.worker(**WORKER_ENV)
            resume_when_lease_lapses(api, source["id"])
            done = wait_for_run(api, source["id"], timeout=300, procs=[clean])
            assert done["status"] == "succeeded", done
            # The pinned step 4 is still on disk and listed; the source's own retention
            # otherwise ran (8 and 12 are its two newest).
            assert [c["step"] for c in checkpoints(api, source["id"])] == [4, 8, 12]
            assert (Path(four["path"]) / OPTIMIZER).is_file()

            resumed = api.post(f"/runs/{tuned['id']}/resume")
            assert resumed.status_code == 200, resumed.text
            finished = wait_for_run(api, tuned["id"], timeout=300, procs=[clean])
            assert finished["status"] == "succeeded", finished
            assert finished["signature"] == tuned["signature"]


def test_a_quarantined_checkpoint_is_reported_and_never_resumed_from_again(
    tmp_path: Path, postgres_url: str
) -> None:
    body = {"workflow": workflow("continued_pretrain", steps=12)}
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        with stack.api() as api:
            run = killed_after_checkpoint(stack, api, body, 8)
            newest = checkpoints(api, run["id"])[-1]
            assert newest["step"] == 8
            optimizer = Path(newest["path"]) / OPTIMIZER
            corrupted = bytearray(optimizer.read_bytes())
            corrupted[len(corrupted) // 2] ^= 0xFF
            optimizer.write_bytes(bytes(corrupted))

            # The next worker is handed 8, quarantines it, resumes from 4 and dies at step 5,
            # before it writes a new 8.
            doomed = stack.worker(
                **WORKER_ENV, TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS="after_step@5"
            )
            resume_when_lease_lapses(api, run["id"])
            assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
            [quarantined] = checkpoints(api, run["id"], "quarantined")
            assert quarantined["step"] == 8
            assert f"{OPTIMIZER} has SHA-256" in quarantined["reason"]
            assert "step-00000008.corrupt-" in quarantined["reason"]
            assert [c["step"] for c in checkpoints(api, run["id"])] == [4]
            assert api.get(f"/runs/{run['id']}").json()["latest_checkpoint"]["step"] == 4

            clean = stack.worker(**WORKER_ENV)
            resume_when_lease_lapses(api, run["id"])
            done = wait_for_run(api, run["id"], timeout=300, procs=[clean])
            assert done["status"] == "succeeded", done
            # Each attempt's claim was handed: 8 (then quarantined), 4, and 4 again.
            assert resumed_from_steps(postgres_url, run["id"]) == [None, 8, 4]
            # The last one wrote 8 anew: usable again.
            every = {c["step"]: c["status"] for c in checkpoints(api, run["id"], "all")}
            assert every[8] == "usable" and every[12] == "usable"
