"""The CLI against a live server, as a user types it: exit codes and what it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from exact import make_initial_checkpoint, workflow
from procs import Stack, cli, processes, run_cli

from contracts.signature import sha256_path

pytestmark = pytest.mark.integration

EXIT_API = 3


def test_cli_creates_pauses_resumes_and_cancels_and_names_a_signature_mismatch(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = workflow("summarization", steps=6)
    (tmp_path / "wf.json").write_text(json.dumps(doc))
    initial = make_initial_checkpoint(tmp_path / "initial", doc["model"]["config"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes((initial / "model.safetensors").read_bytes()[:-8])

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
