"""Real processes for the end-to-end tests: `trainctl serve|up|worker` as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from cli.stack import Proc, child_env, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "workflows" / "demo.json"
TERMINAL = {"succeeded", "failed", "cancelled"}


def short_demo_workflow(*, pretrain_steps: int = 10, sft_steps: int = 6) -> dict[str, Any]:
    """The demo workflow cut to three phases and a few steps, with absolute paths."""
    from runtime.path import resolve_paths

    doc = resolve_paths(json.loads(DEMO.read_text()), DEMO.parent)
    pretrain, summarize, *_, planning = doc["phases"]
    doc["phases"] = [
        {**pretrain, "steps": pretrain_steps, "schedule": {"kind": "wsd", "warmup_steps": 2}},
        {**summarize, "steps": sft_steps, "schedule": {"kind": "cosine", "warmup_steps": 1}},
        {**planning, "steps": sft_steps, "schedule": {"kind": "cosine", "warmup_steps": 1}},
    ]
    doc["checkpoint"] = {"every_steps": 5, "keep_last": 2}
    doc["evals"] = [{**e, "every_steps": 5} for e in doc["evals"]]
    return doc


@contextmanager
def processes() -> Iterator[list[Proc]]:
    """Collects started processes and stops them all, printing their logs on failure."""
    started: list[Proc] = []
    try:
        yield started
    except BaseException:
        for proc in started:
            print(f"--- {proc.log.name} ---\n{proc.tail()}")
        raise
    finally:
        for proc in reversed(started):
            proc.stop()


def start_api(
    args: list[str], *, env: dict[str, str], log: Path, procs: list[Proc]
) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([*args, "--port", str(port)], env=env, log=log)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=90, process=proc.popen)
    except RuntimeError as err:
        raise AssertionError(f"{err}\n{proc.tail()}") from err
    return proc, url


def cli(
    args: list[str], *, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`trainctl ARGS` as a user runs it; the caller checks the exit code."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli(args: list[str], *, env: dict[str, str], timeout: float = 120) -> str:
    result = cli(args, env=env, timeout=timeout)
    assert result.returncode == 0, f"trainctl {' '.join(args)}: {result.stderr}{result.stdout}"
    return result.stdout


def wait_for_run(
    api: httpx.Client, run_id: str, *, timeout: float, procs: list[Proc]
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = api.get(f"/runs/{run_id}").json()
        if run["status"] in TERMINAL:
            return run
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(f"{proc.log.name} exited early:\n{proc.tail()}")
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} did not finish in {timeout} s: {run}")


class Stack:
    """`trainctl serve` on its own Postgres database and Redis queue, with tokens, ready for
    worker processes. Workers are started with `worker()`; all stop when `procs` is closed."""

    def __init__(self, tmp_path: Path, postgres_url: str, procs: list[Proc], **env: str) -> None:
        self.tmp_path, self.procs = tmp_path, procs
        self.env = {
            "TRAINCTL_HOME": str(tmp_path / "home"),
            "TRAINCTL_DATABASE_URL": postgres_url,
            "TRAINCTL_BROKER_URL": "redis://127.0.0.1:6379/0",
            "TRAINCTL_QUEUE": f"test-{uuid.uuid4().hex[:12]}",
            "TRAINCTL_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
            # What the tests' files are read from: the examples and the test's own folder.
            "TRAINCTL_DATA_ROOTS": os.pathsep.join([str(ROOT / "examples"), str(tmp_path)]),
            "TRAINCTL_TORCH_THREADS": "1",
            **env,
        }
        _, self.url = start_api(["serve"], env=self.env, log=tmp_path / "serve.log", procs=procs)
        self.admin = self.token("admin")
        self.worker_token = self.token("worker")
        self.workers = 0

    def token(self, role: str) -> str:
        return run_cli(["tokens", "create", "--name", role, "--role", role], env=self.env).strip()

    def api(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.admin}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def worker(self, **env: str) -> Proc:
        self.workers += 1
        proc = Proc(
            ["worker"],
            env={
                **self.env,
                "TRAINCTL_API_URL": self.url,
                "TRAINCTL_WORKER_TOKEN": self.worker_token,
                **env,
            },
            log=self.tmp_path / f"worker-{self.workers}.log",
        )
        self.procs.append(proc)
        return proc


def wait_until(predicate: Any, *, timeout: float, what: str) -> Any:
    """Poll `predicate` every 0.1 s until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def assert_each_step_once(api: httpx.Client, run: dict[str, Any]) -> None:
    """Every metric series of `run` holds each of its steps exactly once."""
    metrics = api.get(f"/runs/{run['id']}/metrics").json()
    for name, column in metrics.items():
        assert column["steps"] == list(range(1, run["total_steps"] + 1)), name


def resume_when_lease_lapses(api: httpx.Client, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        answer = api.post(f"/runs/{run_id}/resume")
        if answer.status_code != 409 or time.monotonic() > deadline:
            assert answer.status_code == 200, answer.text
            return answer.json()
        assert answer.json()["error"]["code"] == "run_active", answer.text
        time.sleep(0.5)
