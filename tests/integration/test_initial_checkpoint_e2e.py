"""A run started from an initial checkpoint, with real processes: the worker refuses one whose
files changed after the run was created before its first step (naming it and both digests),
and `trainctl runs resume --initial-checkpoint` with the checkpoint the run started from
continues it (the original PR's unresumable SFT run)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import make_initial_checkpoint, workflow
from procs import Stack, cli, processes, wait_for_run
from weights import altered_copy

from contracts.signature import sha256_path

pytestmark = pytest.mark.integration

EXIT_API = 3


def created(api: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post("/runs", json=body)
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    return run


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_worker_refuses_an_initial_checkpoint_changed_after_the_run_was_created(
    tmp_path: Path, postgres_url: str
) -> None:
    """By local path and by {"run", "step"} of another run: each run fails with cause
    signature_mismatch before its first step, its message naming the checkpoint and the
    digest signed with the one found."""
    source_doc = workflow("continued_pretrain", steps=4)
    doc = workflow("summarization", steps=4)
    initial = make_initial_checkpoint(tmp_path / "initial", doc["model"]["config"])
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        with stack.api() as api:
            first = stack.worker()
            source = wait_for_run(
                api, created(api, {"workflow": source_doc})["id"], timeout=120, procs=[first]
            )
            assert source["status"] == "succeeded", source
            first.stop()  # nothing may claim the runs below before their files change

            by_path = created(api, {"workflow": doc, "initial_checkpoint": str(initial)})
            of_run = {"run": source["id"], "step": 4}
            by_run = created(api, {"workflow": doc, "initial_checkpoint": of_run})
            signed = {}
            for run in (by_path, by_run):
                checkpoint = Path(run["initial_checkpoint"])
                signed[run["id"]] = (checkpoint, sha256_path(checkpoint))
                flip_last_byte(checkpoint / "model.safetensors")
            assert by_run["initial_checkpoint"] == source["latest_checkpoint"]["path"]

            second = stack.worker()
            for run_id, (checkpoint, before) in signed.items():
                run = wait_for_run(api, run_id, timeout=120, procs=[second])
                assert (run["status"], run["cause"], run["step"]) == (
                    "failed",
                    "signature_mismatch",
                    0,
                ), run
                [attempt] = run["attempts"]
                assert attempt["cause"] == "signature_mismatch"
                message = attempt["message"]
                assert f"initial checkpoint {checkpoint} has SHA-256 {sha256_path(checkpoint)}" in (
                    message
                ), message
                assert f"computed with {before}" in message, message
                assert api.get(f"/runs/{run_id}/metrics").json() == {}, "no step was taken"


def test_cli_resume_with_the_initial_checkpoint_the_run_started_from_continues_it(
    tmp_path: Path, postgres_url: str
) -> None:
    """A fine-tuning run SIGKILLed after its step-4 checkpoint is resumed by
    `trainctl runs resume RUN --initial-checkpoint X` with the X it was created with: the
    signature is reproduced and the run finishes from step 4. Another checkpoint is refused
    with 409 signature_mismatch naming initial_checkpoint and both digests."""
    doc = workflow("summarization", steps=8)
    (tmp_path / "wf.json").write_text(json.dumps(doc))
    initial = make_initial_checkpoint(tmp_path / "initial", doc["model"]["config"])
    other = altered_copy(initial, tmp_path / "other")

    with processes() as procs:
        # Quick leases so the killed attempt's lapses within the test; the reaper is held
        # back so that the resume under test is the CLI's.
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_LEASE_SECONDS="3",
            TRAINCTL_REAPER_INTERVAL_SECONDS="3600",
        )
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        doomed = stack.worker(
            TRAINCTL_HEARTBEAT_SECONDS="0.5",
            TRAINCTL_TESTING="1",
            TRAINCTL_TEST_FAILPOINTS="after_checkpoint@4",
        )
        create = ["runs", "create", str(tmp_path / "wf.json"), "--json"]
        run_id = json.loads(cli([*create, "--initial-checkpoint", str(initial)], env=env).stdout)[
            "id"
        ]
        assert doomed.popen.wait(timeout=120) == -signal.SIGKILL, doomed.tail()

        refused = cli(["runs", "resume", run_id, "--initial-checkpoint", str(other)], env=env)
        assert refused.returncode == EXIT_API, refused.stdout
        printed = refused.stderr.replace("\n", "")
        assert "[signature_mismatch]" in printed and "initial_checkpoint.sha256" in printed
        assert sha256_path(initial) in printed and sha256_path(other) in printed

        resume = ["runs", "resume", run_id, "--initial-checkpoint", str(initial)]
        deadline = time.monotonic() + 30
        while (answer := cli(resume, env=env)).returncode != 0:
            assert "[run_active]" in answer.stderr, answer.stderr  # until the lease lapses
            assert time.monotonic() < deadline, answer.stderr
            time.sleep(0.5)
        assert "from the checkpoint at step 4" in " ".join(answer.stdout.split()), answer.stdout

        clean = stack.worker()
        with stack.api() as api:
            run = wait_for_run(api, run_id, timeout=120, procs=[clean])
            assert run["status"] == "succeeded", run
            assert [(a["number"], a["status"]) for a in run["attempts"]] == [
                (1, "lost"),
                (2, "succeeded"),
            ]
            assert run["initial_checkpoint"] == str(initial)
            steps = api.get(f"/runs/{run_id}/metrics", params={"names": "loss"}).json()
            assert steps["loss"]["steps"] == list(range(1, 9)), "each step once, none lost"
