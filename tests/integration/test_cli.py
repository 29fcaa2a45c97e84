"""The CLI against a live server, as a user types it: exit codes and what it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from exact import make_initial_checkpoint, workflow
from procs import Stack, cli, processes, run_cli
from weights import altered_copy

from contracts.signature import sha256_path

pytestmark = pytest.mark.integration

EXIT_API = 3


def test_cli_creates_pauses_resumes_and_cancels_and_names_a_signature_mismatch(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = workflow("summarization", steps=6)
    (tmp_path / "wf.json").write_text(json.dumps(doc))
    initial = make_initial_checkpoint(tmp_path / "initial", doc["model"]["config"])
    other = altered_copy(initial, tmp_path / "other")

    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)  # no worker: the run stays queued
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        create = ["runs", "create", str(tmp_path / "wf.json"), "--json"]
        create += ["--initial-checkpoint", str(initial), "--idempotency-key", "k1"]
        created = json.loads(run_cli(create, env=env))
        again = json.loads(run_cli(create, env=env))
        assert again["id"] == created["id"], "the same key gives the same run"
        run_id = created["id"]

        mismatch = cli(["runs", "resume", run_id, "--initial-checkpoint", str(other)], env=env)
        assert mismatch.returncode == EXIT_API
        printed = mismatch.stderr.replace("\n", "")
        assert "initial_checkpoint.sha256" in printed
        assert sha256_path(initial) in printed and sha256_path(other) in printed

        active = cli(["runs", "resume", run_id], env=env)
        assert active.returncode == EXIT_API and "[run_active]" in active.stderr

        assert "paused" in run_cli(["runs", "pause", run_id], env=env)
        assert "resumed run" in run_cli(["runs", "resume", run_id], env=env)
        assert "cancelled" in run_cli(["runs", "cancel", run_id], env=env)

        listed = json.loads(run_cli(["runs", "list", "--json"], env=env))
        assert [(r["id"], r["status"]) for r in listed["runs"]] == [(run_id, "cancelled")]
        shown = run_cli(["runs", "show", run_id], env=env)
        assert "cancelled" in shown and "attempt 2" in shown

        missing = cli(["runs", "show", "run_doesnotexist"], env=env)
        assert missing.returncode == EXIT_API and "run_doesnotexist" in missing.stderr


def test_cli_evaluates_every_eval_set_of_a_workflow_remotely_as_locally(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = workflow("summarization", steps=6)
    summaries = tmp_path / "summaries.jsonl"  # the second record fits 128 tokens, not 64
    records = [
        {"source": "summarize: " + "the map was blue. " * n, "target": " blue."} for n in (3, 12)
    ]
    summaries.write_text("".join(json.dumps(r) + "\n" for r in records))
    doc["evals"] = [  # two sets of one task, each at its own geometry
        {
            "name": "short",
            "task": "summarization",
            "data": "summaries.jsonl",
            "sequence_length": 64,
        },
        {
            "name": "long",
            "task": "summarization",
            "data": "summaries.jsonl",
            "sequence_length": 128,
        },
    ]
    (tmp_path / "wf.json").write_text(json.dumps(doc))
    model = make_initial_checkpoint(tmp_path / "model", doc["model"]["config"])
    args = ["eval", str(model), "--workflow", str(tmp_path / "wf.json")]

    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        stack.worker()
        remote = json.loads(run_cli([*args, "--remote", "--json"], env=env))
        table = run_cli([*args, "--remote"], env={**env, "COLUMNS": "200"})

    local = json.loads(run_cli([*args, "--json"], env=env))
    assert [(r["name"], r["task"]) for r in remote] == [
        ("short", "summarization"),
        ("long", "summarization"),
    ]
    assert [(r["records"], r["oversized_records"]) for r in remote] == [(1, 1), (2, 0)]
    for far, near in zip(remote, local, strict=True):
        assert (far["records"], far["oversized_records"]) == (
            near["records"],
            near["oversized_records"],
        )
        assert far["cross_entropy"] == pytest.approx(near["cross_entropy"], rel=1e-5)
    lines = table.splitlines()
    rows = [line.split() for line in lines[2:4]]
    assert [row[:4] for row in rows] == [
        [r["name"], r["task"], f"{r['records']:,}", f"{r['oversized_records']:,}"] for r in remote
    ]
    # Half of "short" was too long at 64: marked, and the record named from the worker's job.
    assert rows[0][4] == "!" and len(rows[1]) == 6
    assert lines[4:6] == [
        "!: more than 2% of the set's records skipped",
        "short skipped 1 too long, the first:",
    ]
    assert lines[6].startswith(f"  {summaries}:2: encodes to")


def _processes_of_home(home: Path) -> list[int]:
    """Pids of live processes whose environment names TRAINCTL_HOME=home."""
    needle = f"TRAINCTL_HOME={home}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes() + b"\0":
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def test_up_stops_its_workers_when_terminated(tmp_path: Path) -> None:
    """uvicorn raises SIGTERM again after its shutdown; `up` must still stop the workers it
    started (they run in their own sessions and would otherwise outlive it)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cli.stack import free_port, wait_healthy

    port = free_port()
    env = {**os.environ, "TRAINCTL_HOME": str(tmp_path)}
    up = subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=60, process=up)
        deadline = time.monotonic() + 30
        while len(_processes_of_home(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_processes_of_home(tmp_path)) >= 2, "up and its worker"
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while _processes_of_home(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_of_home(tmp_path) == []
    finally:
        if up.poll() is None:
            up.kill()
        for pid in _processes_of_home(tmp_path):
            os.kill(pid, signal.SIGKILL)
