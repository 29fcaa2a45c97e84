"""What operators see: Prometheus metrics of the service and a worker, JSON logs tagged with the
run and attempt, and `trainctl runs watch` following a run, all against real processes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from procs import Stack, cli, processes, run_cli, short_demo_workflow, wait_for_run

from cli.stack import free_port

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def samples(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_logs_and_watch_of_a_run(tmp_path: Path, postgres_url: str) -> None:
    worker_port = free_port()
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_LOG_FORMAT="json")
        worker = stack.worker(TRAINCTL_METRICS_PORT=str(worker_port))
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        workflow = short_demo_workflow(pretrain_steps=6, sft_steps=3)
        with stack.api() as api:
            run = api.post("/runs", json={"workflow": workflow}).json()
            # `watch --json` follows the run to its end: one JSON object per change, exit 0.
            watched = cli(["runs", "watch", run["id"], "--json", "--poll", "0.2"], env=env)
            assert watched.returncode == 0, watched.stderr
            lines = [json.loads(line) for line in watched.stdout.splitlines()]
            run = wait_for_run(api, run["id"], timeout=60, procs=procs)
            service_metrics = samples(httpx.get(f"{stack.url}/metrics").text)
            api.get("/runs/run_doesnotexist")
            after = samples(httpx.get(f"{stack.url}/metrics").text)
            # The read commands' --json is the API's answer.
            evals = json.loads(
                run_cli(["runs", "eval", run["id"], "--json", "--max-points", "2"], env=env)
            )
            shown = json.loads(run_cli(["runs", "show", run["id"], "--json"], env=env))
            # An inspection through the API runs on the worker, like `data inspect` here.
            remote = ["data", "inspect", str(EXAMPLES / "data" / "qa_rag.eval.jsonl"), "--remote"]
            remote += ["--tokenizer", str(EXAMPLES / "tokenizer" / "tokenizer.json")]
            remote += ["--objective", "qa_reasoning", "--sequence-length", "64", "--json"]
            inspected = cli(remote, env=env)
            bad = tmp_path / "bad.jsonl"
            bad.write_text('{"source": "a", "target": " b"}\n{"source": 1}\n')
            remote_bad = [*remote[:2], str(bad), *remote[3:]]
            refused = cli(remote_bad, env=env)
            local_bad = cli([arg for arg in remote_bad if arg != "--remote"], env=env)
            worker_metrics = samples(httpx.get(f"http://127.0.0.1:{worker_port}/metrics").text)
        worker.stop()
        worker_log = worker.log.read_text().splitlines()

    total = run["total_steps"]
    assert run["status"] == "succeeded"
    steps = [line["step"] for line in lines]
    assert steps == sorted(steps) and steps[-1] == total
    assert lines[-1]["status"] == "succeeded" and lines[-1]["total_steps"] == total
    assert {"phase", "tokens_per_s", "restarts", "preemptions"} <= set(lines[-1])

    assert shown["id"] == run["id"] and shown["status"] == "succeeded"
    for summary in evals["tasks"].values():
        assert [p["step"] for p in summary["history"]] == [0, total]
    assert inspected.returncode == 1, inspected.stderr  # 3 records cannot fit: exit 1
    # A line the worker cannot read is counted and named, not fatal, as it is locally: exit 1.
    assert refused.returncode == local_bad.returncode == 1, refused.stderr
    assert json.loads(refused.stdout) == json.loads(local_bad.stdout)
    bad_report = json.loads(refused.stdout)
    assert bad_report["skipped_records"] == {"wrong_shape": 1}
    assert [p["line"] for p in bad_report["problems"]] == [2]
    report = json.loads(inspected.stdout)
    assert (report["records"], report["refused"]) == (48, 3)

    # The service: runs and attempts by status, report ingest, request latency by route.
    assert service_metrics['trainctl_runs{status="succeeded"}'] == 1
    assert service_metrics['trainctl_attempts{status="succeeded"}'] == 3
    assert service_metrics["trainctl_recoveries"] == 0
    assert service_metrics['trainctl_reports_ingested_total{kind="metrics"}'] >= 1
    assert service_metrics['trainctl_reports_ingested_total{kind="finish"}'] == 3
    assert service_metrics["trainctl_database_up"] == 1
    assert (
        after[
            'trainctl_http_request_duration_seconds_count{method="GET",route="/runs/{run_id}",status="404"}'
        ]
        == 1
    )
    # The worker: every step it trained.
    assert worker_metrics["trainctl_worker_steps_total"] == total
    assert worker_metrics["trainctl_worker_step"] == total
    assert worker_metrics['trainctl_worker_attempts_total{status="succeeded"}'] == 3
    assert worker_metrics['trainctl_worker_jobs_total{kind="inspection"}'] == 2

    # JSON logs: every line from an attempt names its run and attempt.
    records = [json.loads(line) for line in worker_log if line.startswith("{")]
    assert records, "\n".join(worker_log[-20:])
    tagged = [r for r in records if r.get("run_id") == run["id"]]
    attempts = {a["id"] for a in run["attempts"]}
    assert {r["attempt_id"] for r in tagged} == attempts
    training = [r for r in records if r["message"].startswith("training attempt")]
    assert len(training) == 3 and all(r in tagged for r in training)
    assert {"ts", "level", "logger", "message"} <= set(records[0])


def test_watch_exits_1_for_a_failed_run_and_3_without_a_service(
    tmp_path: Path, postgres_url: str
) -> None:
    workflow = short_demo_workflow(pretrain_steps=4, sft_steps=2)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"source": "the cat", "target": " sat"}\n{"source": 1}\n')
    workflow["phases"][1]["data"] = [{"path": str(broken)}]
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        with stack.api() as api:
            run = api.post("/runs", json={"workflow": workflow}).json()
            started = time.monotonic()
            watched = cli(["runs", "watch", run["id"], "--poll", "0.2"], env=env)
            assert time.monotonic() - started < 110
    assert watched.returncode == 1, watched.stdout + watched.stderr
    assert "failed" in watched.stderr and "broken.jsonl:2" in " ".join(watched.stderr.split())

    gone = cli(["runs", "watch", run["id"]], env={**env, "TRAINCTL_API_URL": "http://127.0.0.1:9"})
    assert gone.returncode == 3 and "cannot reach" in gone.stderr
