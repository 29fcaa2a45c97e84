from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from contracts.reports import CheckpointRef, Claim
from contracts.signature import sha256_path
from contracts.workflow import ENCODER_VERSION, Workflow
from runtime.digest import clear_digest_cache
from worker.checkpoint.layout import MANIFEST
from worker.link.client import ServiceClient, ServiceUnavailable
from worker.process.claim import claim_request, verify_inputs
from worker.process.runner import run_attempt
from worker.settings import WorkerSettings


class InProcessService:
    """Answers the internal API the way the service does, and records every request. It owns
    no database: the runner is tested against the HTTP contract, not the service's storage.

    Heartbeats from the lease keeper's thread are kept apart (`keeper_beats`) from the loop's
    requests (`posts`): the keeper beats on its own clock, the loop's order is deterministic.
    `order=(action, step)`: once the loop posts the evaluation of `step`, every heartbeat
    answers `action`, and that evaluation's answer waits until the keeper has heard it."""

    def __init__(
        self,
        claim: Claim | None,
        *,
        stop_after_heartbeats: int | None = None,
        order: tuple[str, int] | None = None,
    ) -> None:
        self.claim = claim
        self.stop_after_heartbeats = stop_after_heartbeats
        self.order = order
        self.down_for = 0
        self.superseded_on: str | None = None
        self.unavailable_on: str | None = None
        self.posts: list[tuple[str, dict[str, Any]]] = []
        self.keeper_beats: list[dict[str, Any]] = []
        self._ordered = threading.Condition()
        self._ordering = False
        self._ordered_beats = 0  # keeper heartbeats answered with the order

    def __call__(self, request: httpx.Request) -> httpx.Response:
        kind = request.url.path.rsplit("/", 1)[-1]
        body = json.loads(request.content)
        keeper = threading.current_thread().name.startswith("lease-")
        if kind != "claim" and self.down_for > 0:
            if not keeper:  # down for everyone, for as many of the loop's requests
                self.down_for -= 1
            return httpx.Response(503, json={"error": {"code": "down", "message": "restarting"}})
        if keeper:
            self.keeper_beats.append(body)
        else:
            self.posts.append((kind, body))
        if kind == self.superseded_on:
            return conflict("superseded")
        if kind == self.unavailable_on:
            return httpx.Response(503, json={"error": {"code": "down", "message": "restarting"}})
        if kind == "claim":
            if self.claim is None:
                return conflict("already_claimed")
            return httpx.Response(200, json=self.claim.model_dump(mode="json"))
        if kind == "heartbeat":
            return httpx.Response(200, json={"action": self._action(keeper), "lease_seconds": 60})
        if kind == "metrics":
            return httpx.Response(200, json={"accepted": len(body["points"])})
        if kind == "evals" and self.order is not None:
            action, step = self.order
            if any(r["step"] == step for r in body["results"]):
                self._hold_until_the_keeper_heard(action)
        return httpx.Response(200, json={"accepted": 1})

    def _action(self, keeper: bool) -> str:
        beats = len(self.of("heartbeat"))
        if self.stop_after_heartbeats is not None and beats >= self.stop_after_heartbeats:
            return "stop"
        with self._ordered:
            if not self._ordering:
                return "continue"
            assert self.order is not None
            if keeper:
                self._ordered_beats += 1
                self._ordered.notify_all()
            return self.order[0]

    def _hold_until_the_keeper_heard(self, action: str) -> None:
        # The keeper stores an answer before it sends its next heartbeat: once a second one
        # arrives, the first one's order is what the loop reads. A keeper told to stop sends
        # no second one: it stores the order and ends.
        stop = action == "stop"
        with self._ordered:
            self._ordering = True
            assert self._ordered.wait_for(
                lambda: self._ordered_beats >= (1 if stop else 2), timeout=30
            )
        if stop:
            for thread in threading.enumerate():
                if thread.name.startswith("lease-"):
                    thread.join(timeout=30)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [body for k, body in self.posts if k == kind]

    def kinds(self) -> list[str]:
        return [k for k, _ in self.posts]


def conflict(code: str) -> httpx.Response:
    return httpx.Response(409, json={"error": {"code": code, "message": code, "details": None}})


@pytest.fixture
def settings(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> WorkerSettings:
    # The lease keeper stays silent through these short attempts (its first beat would come
    # after an hour), and buffered points go out at fencing checks and the finish: the
    # requests the loop makes are then the same every run. Tests of the keeper's orders make
    # it beat often (`beating`). The test files (and the session's tokenizer) are the data.
    return WorkerSettings(
        home=tmp_path / "home",
        device="cpu",
        heartbeat_seconds=3600,
        spool_flush_seconds=0,
        data_roots=(tmp_path_factory.getbasetemp(),),
    )


def beating(settings: WorkerSettings) -> WorkerSettings:
    return settings.model_copy(update={"heartbeat_seconds": 0.02})


@pytest.fixture
def workflow(
    make_workflow: Callable[..., Workflow], make_pairs_file: Callable[..., Path]
) -> Workflow:
    return make_workflow(
        [{"name": "sft", "objective": "qa_reasoning", "data": [make_pairs_file()], "steps": 3}],
        evals=[{"task": "qa_reasoning", "data": make_pairs_file("eval.jsonl", seed=4)}],
    )


def attempt(service: InProcessService, settings: WorkerSettings) -> Any:
    client = ServiceClient(
        "http://service", "token", transport=httpx.MockTransport(service), backoff_seconds=0
    )
    return run_attempt("attempt-1", settings=settings, client=client)


def test_a_successful_attempt_reports_everything_then_finishes(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    service = InProcessService(make_claim(workflow))
    outcome = attempt(service, settings)

    assert outcome.status == "succeeded"
    assert service.kinds()[0] == "claim" and service.kinds()[-1] == "finish"
    (finish,) = service.of("finish")
    assert finish == {
        "fencing_token": "claim-secret-7",
        "status": "succeeded",
        "step": 3,
        "cause": None,
        "message": None,
    }
    points = [p for batch in service.of("metrics") for p in batch["points"]]
    assert sorted({p["step"] for p in points}) == [1, 2, 3]
    assert all(b["fencing_token"] == "claim-secret-7" for k, b in service.posts if k != "claim")
    assert service.posts[0][1]["nonce"]  # the claim names itself for its retries
    assert [r["step"] for batch in service.of("evals") for r in batch["results"]] == [0, 3]
    (checkpoint,) = service.of("checkpoints")
    assert checkpoint["checkpoint"]["step"] == 3
    # The loop itself heartbeats only for the fencing check before step 3's checkpoint is put
    # in place, and says how much it has done: inputs hashed, data read, steps, evals.
    (fencing,) = service.of("heartbeat")
    assert fencing["step"] == 3 and fencing["progress"] > 3
    assert service.kinds() == [
        "claim",
        "evals",  # the baseline
        "metrics",  # steps 1 to 3, sent ahead of the next report
        "evals",
        "heartbeat",
        "checkpoints",
        "finish",
    ]


def test_a_duplicate_message_is_dropped(workflow: Workflow, settings: WorkerSettings) -> None:
    service = InProcessService(None)
    assert attempt(service, settings) is None
    assert service.kinds() == ["claim"]


def test_a_changed_data_file_refuses_to_train_naming_the_file_and_digests(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    claim = make_claim(workflow)
    path = workflow.phases[0].data[0].path
    Path(path).write_text(Path(path).read_text() + '{"source": "new", "target": "record"}\n')
    service = InProcessService(claim)
    assert attempt(service, settings) is None

    assert service.kinds() == ["claim", "finish"]
    (finish,) = service.of("finish")
    assert finish["status"] == "failed" and finish["cause"] == "signature_mismatch"
    assert path in finish["message"]
    assert claim.digests.data[path] in finish["message"]  # the expected digest
    assert sha256_path(path) in finish["message"]  # and the actual one


def test_hashing_the_inputs_is_progress_for_every_chunk_read(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
) -> None:
    """Hashing a corpus of many GiB takes minutes: each MiB read tells the lease keeper the
    worker is not hung, not only each file."""
    big = make_text_file(documents=40_000)  # a few MiB
    workflow = make_workflow(
        [{"name": "pt", "objective": "continued_pretrain", "data": [big], "steps": 1}]
    )
    calls: list[int] = []
    clear_digest_cache()  # the session's tokenizer, hashed by an earlier test in this process
    verify_inputs(make_claim(workflow), workflow, lambda: calls.append(1))
    files = [Path(workflow.tokenizer), big]
    chunks = sum(math.ceil(f.stat().st_size / 2**20) for f in files)
    assert math.ceil(big.stat().st_size / 2**20) >= 3
    assert len(calls) == len(files) + chunks  # each file, then each MiB of it


def test_a_worker_of_other_encoding_rules_refuses_the_attempt(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    """A rolling upgrade: the run was signed under other encoding rules than this worker's."""
    claim = make_claim(workflow).model_copy(update={"encoder_version": ENCODER_VERSION - 1})
    service = InProcessService(claim)
    assert attempt(service, settings) is None

    assert service.kinds() == ["claim", "finish"]
    (finish,) = service.of("finish")
    assert finish["status"] == "failed" and finish["cause"] == "config"
    assert f"encoder version {ENCODER_VERSION - 1}" in finish["message"]


def test_bad_data_fails_with_cause_data_naming_file_and_line(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    settings: WorkerSettings,
    tmp_path: Path,
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"source": "a", "target": "b"}\n{"source": "a"}\n')
    workflow = make_workflow(
        [{"name": "sft", "objective": "summarization", "data": [bad], "steps": 2}]
    )
    service = InProcessService(make_claim(workflow))
    attempt(service, settings)
    (finish,) = service.of("finish")
    assert finish["cause"] == "data"
    assert f"{bad}:2: missing field 'target'" in finish["message"]
    assert "attempt attempt-1 of run run-1, phase 0" in finish["message"]


def test_a_corrupt_resume_checkpoint_without_a_fallback_fails_with_cause_checkpoint(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    first = InProcessService(make_claim(workflow))
    attempt(first, settings)
    (registered,) = first.of("checkpoints")
    ref = CheckpointRef.model_validate(registered["checkpoint"])
    (Path(ref.path) / MANIFEST).unlink()  # the only checkpoint: nothing older can stand in

    service = InProcessService(make_claim(workflow, resume_from=ref))
    assert attempt(service, settings) is None

    assert service.kinds() == ["claim", "removals", "finish"]
    (removal,) = service.of("removals")
    assert (removal["step"], removal["status"]) == (3, "quarantined")
    assert f"no {MANIFEST}" in removal["reason"]
    (finish,) = service.of("finish")
    assert (finish["status"], finish["cause"], finish["step"]) == ("failed", "checkpoint", 3)
    assert f"checkpoint {ref.path} (step 3) failed verification" in finish["message"]
    assert "attempt attempt-1 of run run-1, phase 0" in finish["message"]


def test_a_checkpoint_that_does_not_fit_fails_the_attempt_with_cause_disk_full(
    workflow: Workflow,
    make_claim: Callable[..., Claim],
    settings: WorkerSettings,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Another attempt would meet the same full disk: the cause says so, and the service
    fails the run without spending a restart on it (tests/integration/test_recovery_api.py)."""
    claim = make_claim(workflow)
    free = shutil.disk_usage(tmp_path)._replace(free=2**20)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: free)
    service = InProcessService(claim)
    assert attempt(service, settings) is None

    (finish,) = service.of("finish")
    assert (finish["status"], finish["cause"], finish["step"]) == ("failed", "disk_full", 3)
    checkpoints = Path(claim.artifact_dir) / "checkpoints"
    assert f"{checkpoints}: 1.0 MiB free" in finish["message"]
    assert "attempt attempt-1 of run run-1, phase 0" in finish["message"]
    assert "checkpoints" not in service.kinds()
    assert list(checkpoints.iterdir()) == []


def test_any_write_that_runs_out_of_space_fails_the_attempt_with_cause_disk_full(
    workflow: Workflow,
    make_claim: Callable[..., Claim],
    settings: WorkerSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not only a checkpoint: a token store built on a full disk (or the spool, an eval's
    output) would meet the same wall on every retry. Its ENOSPC is disk_full, naming the path,
    and the store's half-written directory is gone."""
    from worker.data import store

    written: list[Path] = []

    def full(path: str, tokenizer: object, key: object, tmp: Path, **_: object) -> None:
        tmp.mkdir()
        written.append(tmp)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "ids.bin"))

    monkeypatch.setattr(store, "_build", full)
    service = InProcessService(make_claim(workflow))
    assert attempt(service, settings) is None

    (finish,) = service.of("finish")
    assert (finish["status"], finish["cause"]) == ("failed", "disk_full")
    assert f"{written[0] / 'ids.bin'}" in finish["message"]
    assert "free" in finish["message"] and "resume" in finish["message"]
    assert not written[0].exists()


def test_a_stop_answer_ends_the_attempt_without_finishing(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    """Heard at the fencing check before the final checkpoint is put in place."""
    service = InProcessService(make_claim(workflow), stop_after_heartbeats=1)
    outcome = attempt(service, settings)
    assert outcome.status == "stopped"
    assert service.kinds()[-1] == "heartbeat"
    assert "finish" not in service.kinds() and "checkpoints" not in service.kinds()


def test_a_stop_heard_by_the_lease_keeper_ends_the_attempt_without_finishing(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    """Heard between steps, from the keeper's thread, after the baseline evaluation."""
    service = InProcessService(make_claim(workflow), order=("stop", 0))
    outcome = attempt(service, beating(settings))
    # At the loop's first check after it, with nothing written.
    assert (outcome.status, outcome.step) == ("stopped", 1)
    assert service.keeper_beats
    assert "finish" not in service.kinds() and "checkpoints" not in service.kinds()


def test_superseded_while_reporting_stops_without_writing(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    claim = make_claim(workflow)
    service = InProcessService(claim)
    service.superseded_on = "metrics"
    assert attempt(service, settings) is None
    assert service.kinds()[-1] == "metrics"
    assert "finish" not in service.kinds()
    assert not list((Path(claim.artifact_dir) / "checkpoints").glob("step-*"))


def test_an_unreachable_service_at_the_end_leaves_the_finish_spooled_for_the_retry(
    workflow: Workflow, make_claim: Callable[..., Claim], settings: WorkerSettings
) -> None:
    service = InProcessService(make_claim(workflow))
    service.unavailable_on = "finish"
    with pytest.raises(ServiceUnavailable, match="the finish last, are spooled"):
        attempt(service, settings)
    assert service.kinds()[-4:] == ["finish"] * 4  # the first try and three retries
    (spooled,) = (settings.spool_dir / "attempt-1").glob("*.json")
    assert json.loads(spooled.read_text())["kind"] == "finish"

    # Celery retries the task: the spool is sent before the claim, which is then refused.
    service.unavailable_on, service.claim = None, None
    assert attempt(service, settings) is None
    assert service.kinds()[-2:] == ["finish", "claim"]
    assert service.of("finish")[-1]["status"] == "succeeded"
    assert list(settings.spool_dir.iterdir()) == []


def test_reports_during_an_outage_arrive_in_order_exactly_once(
    workflow: Workflow,
    make_claim: Callable[..., Claim],
    settings: WorkerSettings,
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = InProcessService(make_claim(workflow))
    # The first report after the claim meets 503 through all of the client's tries; from then
    # on the loop spools without trying (the keeper, silent here, would probe), and the finish
    # delivers the spool, then itself.
    service.down_for = 4
    with caplog.at_level(logging.WARNING):
        outcome = attempt(service, settings)
    assert outcome.status == "succeeded"
    assert "spooling reports from now on" in caplog.text
    delivered = service.kinds()
    assert delivered[-1] == "finish" and delivered.count("finish") == 1
    points = [(p["name"], p["step"]) for b in service.of("metrics") for p in b["points"]]
    assert len(points) == len(set(points)) and sorted({s for _, s in points}) == [1, 2, 3]
    assert [r["step"] for b in service.of("evals") for r in b["results"]] == [0, 3]
    assert [c["checkpoint"]["step"] for c in service.of("checkpoints")] == [3]
    assert list(settings.spool_dir.iterdir()) == []


def test_a_pause_heard_by_the_lease_keeper_checkpoints_and_finishes_paused(
    make_workflow: Callable[..., Workflow],
    make_pairs_file: Callable[..., Path],
    make_claim: Callable[..., Claim],
    settings: WorkerSettings,
) -> None:
    workflow = make_workflow(
        [{"name": "sft", "objective": "qa_reasoning", "data": [make_pairs_file()], "steps": 6}],
        evals=[{"task": "qa_reasoning", "data": make_pairs_file("eval.jsonl"), "every_steps": 2}],
    )
    service = InProcessService(make_claim(workflow), order=("pause", 2))
    outcome = attempt(service, beating(settings))
    assert (outcome.status, outcome.step) == ("paused", 2)
    # The fencing check before the pause checkpoint is put in place, the checkpoint, the finish.
    assert service.kinds()[-3:] == ["heartbeat", "checkpoints", "finish"]
    assert service.of("checkpoints")[0]["checkpoint"]["step"] == 2
    assert service.of("finish")[0]["status"] == "paused"
    assert service.of("finish")[0]["step"] == 2
    # The keeper's heartbeats follow the loop: steps and progress never go back.
    beats = [(b["step"], b["progress"]) for b in service.keeper_beats]
    assert beats == sorted(beats) and beats[-1][0] == 2


# --- the claim's nonce --------------------------------------------------------------------

# One worker process as a container runs it: hostname "trainer", pid 1 (every container of one
# image has both), claiming for Celery delivery "task-1".
_CONTAINER_CLAIM = """
import os, socket
os.getpid = lambda: 1
socket.gethostname = lambda: "trainer"
from worker.process.claim import claim_request
print(claim_request("task-1").model_dump_json())
"""


def _claim_in_a_new_process() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CONTAINER_CLAIM],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    assert done.returncode == 0, done.stderr
    claim: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return claim


def test_two_containers_with_one_hostname_and_pid_claim_one_message_with_different_nonces() -> None:
    """The service hands a claim back to a retry that presents its nonce: two processes that
    make the same nonce (same delivery, hostname and pid) would share one claim."""
    first, second = _claim_in_a_new_process(), _claim_in_a_new_process()
    same = ("trainer", 1)
    assert (first["hostname"], first["pid"]) == (second["hostname"], second["pid"]) == same
    assert first["nonce"] != second["nonce"]


def test_a_process_retrying_one_message_claims_with_the_same_nonce() -> None:
    assert claim_request("task-1").nonce == claim_request("task-1").nonce
    assert claim_request("task-1").nonce != claim_request("task-2").nonce
