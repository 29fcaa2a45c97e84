"""The walking skeleton, end to end: POST /runs -> Celery -> worker training -> GET /eval.

Real processes throughout: `trainctl serve` (uvicorn) on a fresh Postgres database, a Celery
worker process (`trainctl worker`) on Redis, and the same through `trainctl up` (SQLite and the
broker folder). No eager mode, no mocks.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Stack, processes, run_cli, short_demo_workflow, start_api, wait_for_run

pytestmark = pytest.mark.integration

TASKS = {
    "continued_pretrain",
    "summarization",
    "instruction_tuning",
    "qa_reasoning",
    "retrieval_planning",
}


def assert_trained_and_evaluated(
    api: httpx.Client, run: dict[str, Any], *, worker_pid: int
) -> None:
    total = run["total_steps"]
    assert run["status"] == "succeeded", run
    assert run["step"] == total

    # One attempt per phase, each claimed by the worker process and finished.
    attempts = sorted(run["attempts"], key=lambda a: a["number"])
    assert [a["phase_index"] for a in attempts] == [0, 1, 2]
    assert {a["status"] for a in attempts} == {"succeeded"}
    assert {a["worker_pid"] for a in attempts} == {worker_pid}
    assert all(a["worker_hostname"] for a in attempts)

    # Every optimizer step reported exactly once, and the loss fell.
    metrics = api.get(f"/runs/{run['id']}/metrics").json()
    assert metrics["loss"]["steps"] == list(range(1, total + 1))
    for name in ("lr", "grad_norm", "tokens_per_s"):
        assert len(metrics[name]["steps"]) == total, name
    pretrain = metrics["loss"]["values"][:10]
    assert pretrain[-1] < pretrain[0]

    # Per task: a baseline before the first update, and a final number that beats it.
    evals = api.get(f"/runs/{run['id']}/eval").json()["tasks"]
    assert set(evals) == TASKS
    for task, summary in evals.items():
        assert summary["baseline"]["step"] == 0, task
        assert summary["latest"]["step"] == total, task
        assert summary["latest"]["perplexity"] < summary["baseline"]["perplexity"], task
        assert summary["latest"]["target_tokens"] > 0
        steps = [p["step"] for p in summary["history"]]
        assert steps == sorted(set(steps)) and steps[0] == 0

    # The final checkpoint loads with plain transformers, tokenizer included.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(run["latest_checkpoint"]["path"])
    assert run["latest_checkpoint"]["step"] == total
    assert checkpoint.name == f"step-{total:08d}"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config.vocab_size == 512
    assert tokenizer("on monday ada")["input_ids"]


def test_run_trains_through_postgres_redis_and_a_celery_worker(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        worker = stack.worker()
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": short_demo_workflow(), "name": "e2e"})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
            assert_trained_and_evaluated(api, run, worker_pid=worker.pid)

            # The CLI reads the same run through the API.
            cli_env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
            shown = run_cli(["runs", "show", run["id"]], env=cli_env)
            assert "succeeded" in shown


def test_embedded_stack_trains_on_sqlite_and_the_broker_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # Nothing but the home: the database, broker and artifacts take their embedded defaults.
    env = {"TRAINCTL_HOME": str(home), "TRAINCTL_TORCH_THREADS": "1"}
    with processes() as procs:
        stack, url = start_api(
            ["up", "--workers", "1"], env=env, log=tmp_path / "up.log", procs=procs
        )
        token_file = home / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            assert api.get("/runs", headers={"Authorization": ""}).status_code == 401
            created = api.post("/runs", json={"workflow": short_demo_workflow()})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
            # `up` runs its worker as a child: the attempts name that child's pid.
            worker_pid = run["attempts"][0]["worker_pid"]
            assert worker_pid != stack.pid
            assert_trained_and_evaluated(api, run, worker_pid=worker_pid)
        assert (home / "trainctl.db").exists()
