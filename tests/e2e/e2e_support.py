"""Test data for the dashboard and event tests: runs on a live `trainctl serve`, driven through
the worker protocol over HTTP (`/internal/attempts/...` with a worker token), with curves shaped
like real training. No Celery worker runs: the tests decide when each step is reported.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis
from procs import Stack, processes, short_demo_workflow

TASKS = (
    "continued_pretrain",
    "instruction_tuning",
    "qa_reasoning",
    "retrieval_planning",
    "summarization",
)
# Eval sets by name, with their tasks: one per task, and a second set of qa_reasoning.
SETS = {**{task: task for task in TASKS}, "qa-rag": "qa_reasoning"}
EVAL_EVERY = 5
CHECKPOINT_EVERY = 10
# Three phases (pretrain, summarization, planning): steps 1-30, 31-45, 46-60.
PRETRAIN_STEPS = 30
SFT_STEPS = 15
TOTAL_STEPS = PRETRAIN_STEPS + 2 * SFT_STEPS


def loss_at(step: int) -> float:
    return 1.6 + 4.4 * math.exp(-step / 12) + 0.06 * math.sin(step * 1.7)


def lr_at(step: int, phase: dict[str, Any]) -> float:
    """Warmup for 2 steps, then flat, then a linear decay over the phase's last fifth."""
    position = step - phase["first_step"] + 1
    peak = 3e-3 if phase["objective"] == "continued_pretrain" else 1e-3
    decay_from = phase["steps"] * 0.8
    if position <= 2:
        return peak * position / 2
    if position > decay_from:
        return peak * max(0.1, (phase["steps"] - position + 1) / (phase["steps"] - decay_from))
    return peak


def perplexity_at(name: str, step: int) -> float:
    """The perplexity the eval set `name` (SETS) reports at `step`."""
    start = 30.0 + 6.0 * list(SETS).index(name)
    return 1.8 + start * math.exp(-step / 25)


def metric_points(step: int, phase: dict[str, Any]) -> list[dict[str, Any]]:
    lr = lr_at(step, phase)
    return [
        {"name": "loss", "step": step, "value": loss_at(step)},
        {"name": "lr", "step": step, "value": lr},
        {"name": "lr_muon", "step": step, "value": lr * 20},
        {"name": "grad_norm", "step": step, "value": 1.0 + 3.0 * math.exp(-step / 10)},
        {"name": "tokens_per_s", "step": step, "value": 5000.0 + step},
    ]


def eval_results(step: int, phase: str) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "task": task,
            "step": step,
            "phase": phase,
            "cross_entropy": math.log(perplexity_at(name, step)),
            "perplexity": perplexity_at(name, step),
            "records": 8,
            "target_tokens": 160,
            "oversized_records": 0,
        }
        for name, task in SETS.items()
    ]


class ReportingWorker:
    """One attempt's worker side over HTTP, the requests a real worker makes."""

    def __init__(self, url: str, token: str, attempt_id: str) -> None:
        self.attempt_id = attempt_id
        self.fencing_token: str | None = None
        self.artifact_dir: str | None = None  # from the claim: checkpoints go under it
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def post(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(f"/internal/attempts/{self.attempt_id}/{action}", json=body)
        assert response.status_code == 200, f"{action}: {response.status_code} {response.text}"
        return dict(response.json())

    def claim(self) -> dict[str, Any]:
        claim = self.post(
            "claim", {"hostname": "e2e-gpu-1", "pid": 4242, "nonce": uuid.uuid4().hex}
        )
        self.fencing_token = claim["fencing_token"]
        self.artifact_dir = claim["artifact_dir"]
        return claim

    def metrics(self, points: list[dict[str, Any]]) -> None:
        self.post("metrics", {"fencing_token": self.fencing_token, "points": points})

    def evals(self, results: list[dict[str, Any]]) -> None:
        self.post("evals", {"fencing_token": self.fencing_token, "results": results})

    def checkpoint(self, step: int, phase_index: int, phase_step: int) -> None:
        ref = {
            "path": f"{self.artifact_dir}/checkpoints/step-{step:08d}",
            "step": step,
            "phase_index": phase_index,
            "phase_step": phase_step,
        }
        self.post("checkpoints", {"fencing_token": self.fencing_token, "checkpoint": ref})

    def heartbeat(self, step: int) -> None:
        self.post("heartbeat", {"fencing_token": self.fencing_token, "step": step})

    def finish(self, status: str, step: int) -> None:
        self.post("finish", {"fencing_token": self.fencing_token, "status": status, "step": step})

    def close(self) -> None:
        self.client.close()


class LiveStack:
    """`trainctl serve` on its own Postgres database and Redis queue, and the runs on it."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.url = stack.url
        self.admin_token = stack.admin
        self.api = stack.api()
        self.workers: list[ReportingWorker] = []

    def submit(self, name: str) -> dict[str, Any]:
        workflow = short_demo_workflow(pretrain_steps=PRETRAIN_STEPS, sft_steps=SFT_STEPS)
        response = self.api.post("/runs", json={"workflow": workflow, "name": name})
        assert response.status_code == 201, response.text
        return dict(response.json())

    def run(self, run_id: str) -> dict[str, Any]:
        response = self.api.get(f"/runs/{run_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def claim_next(self, run_id: str) -> tuple[ReportingWorker, dict[str, Any]]:
        """Claim the run's newest attempt, as a worker receiving its message does."""
        attempt = max(self.run(run_id)["attempts"], key=lambda a: a["number"])
        assert attempt["status"] == "queued", attempt
        worker = ReportingWorker(self.url, self.stack.worker_token, attempt["id"])
        self.workers.append(worker)
        return worker, worker.claim()

    def train(
        self,
        worker: ReportingWorker,
        run: dict[str, Any],
        phase_index: int,
        *,
        first: int,
        last: int,
    ) -> None:
        """Report steps first..last of a phase: metrics, evaluations every EVAL_EVERY steps (and
        the baseline at step 0), checkpoints every CHECKPOINT_EVERY steps and at the phase end."""
        phase = run["plan"]["phases"][phase_index]
        if first == 1:
            worker.evals(eval_results(0, phase["name"]))
        worker.metrics([p for step in range(first, last + 1) for p in metric_points(step, phase)])
        due = [s for s in range(first, last + 1) if s % EVAL_EVERY == 0]
        for step in due:
            worker.evals(eval_results(step, phase["name"]))
        for step in range(first, last + 1):
            if step % CHECKPOINT_EVERY == 0 or step == phase["last_step"]:
                worker.checkpoint(step, phase_index, step - phase["first_step"] + 1)
        worker.heartbeat(last)

    def finished_run(self, name: str = "finished-e2e") -> str:
        """A run trained through all three phases to `succeeded`."""
        run = self.submit(name)
        for index, phase in enumerate(run["plan"]["phases"]):
            worker, _ = self.claim_next(run["id"])
            self.train(worker, run, index, first=phase["first_step"], last=phase["last_step"])
            worker.finish("succeeded", phase["last_step"])
        assert self.run(run["id"])["status"] == "succeeded"
        return str(run["id"])

    def running_run(self, *, until: int, name: str = "running-e2e") -> tuple[str, ReportingWorker]:
        """A run trained to step `until` and still running; its worker is returned to report
        more (the lease lasts long enough for a test: TRAINCTL_LEASE_SECONDS)."""
        run = self.submit(name)
        phases = run["plan"]["phases"]
        for index, phase in enumerate(phases):
            worker, _ = self.claim_next(run["id"])
            if until <= phase["last_step"]:
                if until >= phase["first_step"]:
                    self.train(worker, run, index, first=phase["first_step"], last=until)
                return str(run["id"]), worker
            self.train(worker, run, index, first=phase["first_step"], last=phase["last_step"])
            worker.finish("succeeded", phase["last_step"])
        raise AssertionError(f"step {until} is past the run's last step")

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.api.close()


@contextmanager
def live_stack(tmp_path: Path, postgres_url: str, redis_url: str) -> Iterator[LiveStack]:
    """A LiveStack, stopped afterwards; the Celery messages its runs left in Redis (no worker
    consumes them here) are deleted."""
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LEASE_SECONDS="600")
        live = LiveStack(stack)
        try:
            yield live
        finally:
            live.close()
            client = redis.Redis.from_url(redis_url)
            try:
                queue = stack.env["TRAINCTL_QUEUE"]
                client.delete(queue, *client.scan_iter(match=f"_kombu.binding*.{queue}"))
            finally:
                client.close()


def parse_events(text: str) -> list[tuple[str, Any]]:
    """A text/event-stream as (event, data) pairs, comments as ("comment", text)."""
    events: list[tuple[str, Any]] = []
    name, data = "message", []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line.startswith(":"):
            events.append(("comment", line[1:].strip()))
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
        elif line == "" and data:
            events.append((name, json.loads("\n".join(data))))
            name, data = "message", []
    return events
