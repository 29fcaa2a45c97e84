"""Jobs end to end: POST /datasets/inspect and POST /evaluations -> outbox -> Redis -> a Celery
worker process (`trainctl worker`) -> the outcome posted back -> GET.

Real processes throughout: `trainctl serve` on a fresh Postgres database, a worker on Redis,
the shipped tokenizer, a real (tiny, untrained) model. No eager mode, no mocks.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import make_initial_checkpoint
from procs import DEMO, ROOT, Proc, Stack, processes

from contracts.jobs import InspectionReport
from contracts.reports import EvalResult

pytestmark = pytest.mark.integration

TOKENIZER = ROOT / "examples" / "tokenizer" / "tokenizer.json"
SUMMARIES = ROOT / "examples" / "data" / "summarization.eval.jsonl"
SEQUENCE_LENGTH = 64
FINISHED = {"succeeded", "failed"}


def wait_for_job(
    api: httpx.Client, location: str, *, timeout: float, procs: list[Proc]
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(location).json()
        if job["status"] in FINISHED:
            return job
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.log.name} exited early:\n{proc.tail()}")
        time.sleep(0.3)
    raise AssertionError(f"job {location} did not finish in {timeout} s: {job}")


def submit(api: httpx.Client, route: str, body: dict[str, Any]) -> str:
    answer = api.post(route, json=body)
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "queued"
    location: str = answer.headers["location"]
    return location


def write_summaries(path: Path, *, records: int) -> None:
    """`records` short pairs, then one whose source is far longer than SEQUENCE_LENGTH."""
    lines = [
        {"source": f"summarize: on monday ada read report {i}. summary:", "target": " ada read."}
        for i in range(records - 1)
    ]
    lines.append({"source": "summarize: " + "the map was blue. " * 100, "target": " blue."})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_inspection_and_evaluation_jobs_run_on_a_celery_worker(
    tmp_path: Path, postgres_url: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(TOKENIZER, data / "tokenizer.json")
    write_summaries(data / "summaries.jsonl", records=12)
    (data / "broken.jsonl").write_text('{"source": "a", "target": "b"}\nnot json\n')
    (data / "vanishing.jsonl").write_text('{"source": "a", "target": "b"}\n')
    model = json.loads(DEMO.read_text())["model"]["config"]
    # A save_pretrained directory without a tokenizer: the request names one.
    checkpoint = make_initial_checkpoint(data / "model", model)

    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(data))
        with stack.api() as api:
            inspect = {
                "tokenizer": "tokenizer.json",
                "objective": "summarization",
                "sequence_length": SEQUENCE_LENGTH,
            }
            # Submitted before any worker runs: the jobs wait in Redis.
            inspection = submit(api, "/datasets/inspect", {**inspect, "path": "summaries.jsonl"})
            broken = submit(api, "/datasets/inspect", {**inspect, "path": "broken.jsonl"})
            vanishing = submit(api, "/datasets/inspect", {**inspect, "path": "vanishing.jsonl"})
            evaluation = submit(
                api,
                "/evaluations",
                {
                    "checkpoint": "model",
                    "task": "summarization",
                    "data": str(SUMMARIES),
                    "tokenizer": "tokenizer.json",
                    "sequence_length": 128,
                    "batch_size": 4,
                },
            )
            # The file exists when the job is accepted and is gone when the worker reads it.
            (data / "vanishing.jsonl").unlink()
            stack.worker()

            job = wait_for_job(api, inspection, timeout=180, procs=procs)
            assert job["status"] == "succeeded", job
            assert job["request"]["path"] == str(data / "summaries.jsonl")
            report = InspectionReport.model_validate(job["result"])
            assert report.path == str(data / "summaries.jsonl")
            assert report.records == 12
            assert (report.fit, report.refused) == (11, 1)
            assert report.formats == {"pair": 12}
            assert [p.line for p in report.problems] == [12]
            assert report.lengths["total"].max > SEQUENCE_LENGTH + 1

            # A line that is not a record is counted and named, as evaluation would skip it
            # and training refuse it; the inspection does not fail on it.
            job = wait_for_job(api, broken, timeout=60, procs=procs)
            assert job["status"] == "succeeded", job
            report = InspectionReport.model_validate(job["result"])
            assert (report.records, report.fit, report.refused) == (2, 1, 1)
            assert report.skipped_records == {"malformed_json": 1}
            assert [(p.line, p.reason.split(" (")[0]) for p in report.problems] == [
                (2, "not valid JSON")
            ]

            job = wait_for_job(api, vanishing, timeout=60, procs=procs)
            assert job["status"] == "failed", job
            assert str(data / "vanishing.jsonl") in job["error"]

            job = wait_for_job(api, evaluation, timeout=300, procs=procs)
            assert job["status"] == "succeeded", job
            assert job["request"]["checkpoint"] == str(checkpoint)
            result = EvalResult.model_validate(job["result"])
            assert result.task == "summarization"
            assert result.records + result.oversized_records == 48
            assert result.records > 0 and result.target_tokens > 0
            assert math.isfinite(result.cross_entropy) and result.cross_entropy > 0
            assert math.isclose(result.perplexity, math.exp(result.cross_entropy), rel_tol=1e-6)

            # Each job reads back only under its own kind.
            elsewhere = evaluation.replace("/evaluations", "/datasets/inspections")
            assert api.get(elsewhere).status_code == 404
