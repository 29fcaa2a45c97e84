"""Two runs to compare, as a person makes them: the same workflow, then one data file edited in
place and the learning rate lowered. They are created with POST /runs on a live server and
report through the worker protocol (a worker token's claim), so no worker needs to train.
Used by the API and CLI tests (tests/integration/test_compare_api.py) and the dashboard's
(tests/e2e/test_compare_view.py)."""

from __future__ import annotations

import copy
import json
import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from procs import ROOT, short_demo_workflow

from contracts.signature import sha256_file

SUMMARIES = ROOT / "examples" / "data" / "summarization.train.jsonl"
FIRST_LR, SECOND_LR = 0.003, 0.001
# The sets short_demo_workflow evaluates (one per task of the demo).
EVAL_SETS = (
    "continued_pretrain",
    "instruction_tuning",
    "qa_reasoning",
    "retrieval_planning",
    "summarization",
)


@dataclass
class Pair:
    """The two runs (their POST /runs answers) and what differs between their inputs."""

    first: dict[str, Any]
    second: dict[str, Any]
    data_path: str
    sha_before: str
    sha_after: str

    @property
    def ids(self) -> tuple[str, str]:
        return self.first["id"], self.second["id"]


def submit(api: httpx.Client, doc: dict[str, Any], name: str) -> dict[str, Any]:
    response = api.post("/runs", json={"workflow": doc, "name": name})
    assert response.status_code == 201, response.text
    return dict(response.json())


def differing_pair(
    api: httpx.Client, folder: Path, *, pretrain_steps: int = 20, sft_steps: int = 6
) -> Pair:
    """Run 1 on a copy of the summarization data in `folder` (inside the server's data
    roots), then that file gains a record and run 2, otherwise the same but for AdamW's
    learning rate (FIRST_LR, then SECOND_LR), is created on it."""
    data = folder / "summaries.jsonl"
    shutil.copy(SUMMARIES, data)
    doc = short_demo_workflow(pretrain_steps=pretrain_steps, sft_steps=sft_steps)
    doc["phases"][1]["data"] = [{"path": str(data)}]
    doc["optimizer"]["adamw_lr"] = FIRST_LR
    sha_before = sha256_file(data)
    first = submit(api, doc, "baseline-lr")
    with data.open("a") as f:
        f.write(json.dumps({"source": "one more text to sum up", "target": "more"}) + "\n")
    second_doc = copy.deepcopy(doc)
    second_doc["optimizer"]["adamw_lr"] = SECOND_LR
    second = submit(api, second_doc, "lower-lr")
    return Pair(first, second, str(data), sha_before, sha256_file(data))


def loss_of(run: int, step: int) -> float:
    """Run `run`'s (0 or 1) training loss at `step`: the second learns a little slower."""
    return 1.5 + 4.0 * math.exp(-step / (8.0 + 4.0 * run))


def lr_of(run: int, step: int) -> float:
    return (FIRST_LR, SECOND_LR)[run] * min(1.0, step / 2)


def perplexity_of(run: int, name: str, step: int) -> float:
    start = 30.0 + 5.0 * EVAL_SETS.index(name)
    return 2.0 + run * 0.5 + start * math.exp(-step / (20.0 + 10.0 * run))


class Reporter:
    """One attempt's worker side over HTTP, with a worker token: claim, then report."""

    def __init__(self, url: str, worker_token: str, attempt_id: str) -> None:
        self.attempt_id = attempt_id
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {worker_token}"}, timeout=30
        )
        self.fencing_token: str | None = None
        self.artifact_dir: str | None = None  # from the claim: checkpoints go under it

    def post(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(f"/internal/attempts/{self.attempt_id}/{action}", json=body)
        assert response.status_code == 200, f"{action}: {response.status_code} {response.text}"
        return dict(response.json())

    def claim(self) -> None:
        claim = self.post("claim", {"hostname": "cmp-gpu", "pid": 77, "nonce": uuid.uuid4().hex})
        self.fencing_token = claim["fencing_token"]
        self.artifact_dir = claim["artifact_dir"]

    def metrics(self, run: int, steps: range) -> None:
        points = [
            {"name": name, "step": step, "value": value}
            for step in steps
            for name, value in (("loss", loss_of(run, step)), ("lr", lr_of(run, step)))
        ]
        self.post("metrics", {"fencing_token": self.fencing_token, "points": points})

    def evals(self, run: int, step: int, phase: str) -> None:
        results = [
            {
                "name": name,
                "task": name,
                "step": step,
                "phase": phase,
                "cross_entropy": math.log(perplexity_of(run, name, step)),
                "perplexity": perplexity_of(run, name, step),
                "records": 8,
                "target_tokens": 160,
                "oversized_records": 0,
            }
            for name in EVAL_SETS
        ]
        self.post("evals", {"fencing_token": self.fencing_token, "results": results})

    def heartbeat(self, step: int) -> None:
        self.post("heartbeat", {"fencing_token": self.fencing_token, "step": step})

    def checkpoint(self, step: int, phase_index: int, phase_step: int) -> None:
        ref = {
            "path": f"{self.artifact_dir}/checkpoints/step-{step:08d}",
            "step": step,
            "phase_index": phase_index,
            "phase_step": phase_step,
        }
        self.post("checkpoints", {"fencing_token": self.fencing_token, "checkpoint": ref})

    def finish(self, step: int) -> None:
        self.post(
            "finish", {"fencing_token": self.fencing_token, "status": "succeeded", "step": step}
        )

    def close(self) -> None:
        self.client.close()


def report_first_phase(
    url: str, worker_token: str, run: dict[str, Any], index: int, *, until: int
) -> Reporter:
    """Claim the run's first attempt and report steps 1..until of its first phase: loss and lr
    at every step, every eval set at step 0 and at every fifth step. The attempt stays
    running (its reporter is returned to report more)."""
    reporter = Reporter(url, worker_token, run["attempts"][0]["id"])
    reporter.claim()
    phase = run["plan"]["phases"][0]["name"]
    reporter.evals(index, 0, phase)
    reporter.metrics(index, range(1, until + 1))
    for step in range(5, until + 1, 5):
        reporter.evals(index, step, phase)
    reporter.heartbeat(until)
    return reporter


def newest_attempt(api: httpx.Client, run_id: str) -> dict[str, Any]:
    run = api.get(f"/runs/{run_id}").json()
    return dict(max(run["attempts"], key=lambda a: a["number"]))


def train(
    api: httpx.Client, worker_token: str, run: dict[str, Any], index: int, *, until: int
) -> Reporter:
    """Report run `run` (number `index` of the pair) through its phases up to step `until`, as
    workers would: each phase's attempt claimed, loss and lr at every step, every eval set at
    step 0 and every fifth step, a checkpoint and a successful finish at each phase's end.
    Returns the reporter of the phase that holds `until` (still running, unless `until` is
    the run's last step)."""
    url = str(api.base_url).rstrip("/")
    reporter: Reporter | None = None
    for phase_index, phase in enumerate(run["plan"]["phases"]):
        first, last = phase["first_step"], phase["last_step"]
        if first > until:
            break
        reporter = Reporter(url, worker_token, newest_attempt(api, run["id"])["id"])
        reporter.claim()
        if first == 1:
            reporter.evals(index, 0, phase["name"])
        end = min(last, until)
        reporter.metrics(index, range(first, end + 1))
        for step in range(first, end + 1):
            if step % 5 == 0:
                reporter.evals(index, step, phase["name"])
        if end == last:
            reporter.checkpoint(last, phase_index, last - first + 1)
            reporter.finish(last)
            if last < until:
                reporter.close()
        else:
            reporter.heartbeat(end)
    assert reporter is not None
    return reporter
