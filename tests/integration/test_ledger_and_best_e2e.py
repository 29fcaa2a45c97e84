"""The token ledger and best checkpoints with a real worker process: a run trains, its ledger
reads back what the worker counted against the plan, retention deletes the neighbours of the
best checkpoint of a set that `checkpoint.keep_best` names and keeps it, and the CLI shows the
ledger and starts a run from that best checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import DEMO, Stack, processes, run_cli, wait_for_run
from test_resume_e2e import SERVICE_ENV, WORKER_ENV

from runtime.path import resolve_paths

pytestmark = pytest.mark.integration

RAMP = 16  # pretraining steps, the learning rate rising the whole phase


def ramp_then_sft() -> dict[str, Any]:
    """The demo model. Pretraining whose learning rate rises linearly over its 16 steps to a
    peak far too high: its held-out loss is best early (at step 4 on CPU) and worse at every
    later checkpoint (every 4 steps, the 2 newest kept). Then 4 supervised steps replaying
    pretraining text as a fifth of their tokens (weight 0.25 to 1), two microbatches a step."""
    doc = resolve_paths(json.loads(DEMO.read_text()), DEMO.parent)
    pretrain, summarize = doc["phases"][:2]
    doc["optimizer"] = {"muon_lr": 1.0, "adamw_lr": 0.5, "grad_clip": 1.0}
    doc["checkpoint"] = {"every_steps": 4, "keep_last": 2, "keep_best": ["pretrain"]}
    held_out = doc["evals"][0]["data"]
    doc["evals"] = [
        {"name": "pretrain", "task": "continued_pretrain", "data": held_out, "every_steps": 4}
    ]
    ramp = {"kind": "cosine", "warmup_steps": RAMP, "min_lr_ratio": 1.0}
    replay = {
        "name": "replay",
        "path": pretrain["data"][0]["path"],
        "weight": 0.25,
        "objective": "continued_pretrain",
        "sequence_length": 128,
        "microbatch_size": 4,
    }
    doc["phases"] = [
        {**pretrain, "steps": RAMP, "schedule": ramp},
        {
            **summarize,
            "steps": 4,
            "grad_accum": 2,
            "lr_scale": 0.01,
            "data": [*summarize["data"], replay],
        },
    ]
    return doc


def last_points(api: httpx.Client, run_id: str, name: str, first: int, last: int) -> float:
    series = api.get(f"/runs/{run_id}/metrics", params={"names": name}).json()[name]
    inside = [
        v for s, v in zip(series["steps"], series["values"], strict=True) if first <= s <= last
    ]
    return float(inside[-1])


def test_a_trained_runs_ledger_and_its_kept_best_checkpoint(
    tmp_path: Path, postgres_url: str
) -> None:
    doc = ramp_then_sft()
    (tmp_path / "wf.json").write_text(json.dumps(doc))
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, **SERVICE_ENV)
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        worker = stack.worker(**WORKER_ENV)
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=[worker])
            assert run["status"] == "succeeded", run
            run_id = run["id"]

            # --- best checkpoint: the lowest held-out loss among the checkpoint steps
            evals = api.get(f"/runs/{run_id}/eval").json()["tasks"]["pretrain"]["history"]
            loss = {p["step"]: p["cross_entropy"] for p in evals}
            best = min((4, 8, 12, 16, 20), key=lambda s: loss[s])
            # The premise: the ramp made an early step best (else this proves nothing).
            assert best < 12, loss
            answer = api.get(f"/runs/{run_id}/checkpoints", params={"status": "all"}).json()
            status = {c["step"]: c["status"] for c in answer["checkpoints"]}
            [kept] = answer["best"]
            assert (kept["name"], kept["kept"], kept["step"]) == ("pretrain", True, best)
            # Retention deleted its neighbours and kept it, files and all: the two newest
            # (16, 20: also each phase's final) and the best remain.
            assert {s for s, st in status.items() if st == "usable"} == {best, 16, 20}
            assert {s for s, st in status.items() if st == "deleted"} == {4, 8, 12} - {best}
            path = next(c["path"] for c in answer["checkpoints"] if c["step"] == best)
            assert (Path(path) / "model.safetensors").is_file()

            # --- the ledger: the worker's counts against the plan
            ledger = api.get(f"/runs/{run_id}/ledger").json()
            pretraining, supervised = ledger["phases"]
            assert pretraining["trained_tokens"] == pretraining["planned_tokens"] == RAMP * 512
            (text,) = pretraining["sources"]
            assert text["epochs"] > 0 and text["target_tokens"] == text["trained_tokens"]
            summaries, replay = supervised["sources"]
            for source in (summaries, replay):
                name = source["name"]
                assert source["trained_tokens"] == last_points(
                    api, run_id, f"tokens/{name}", 17, 20
                )
                assert source["target_tokens"] == last_points(
                    api, run_id, f"target_tokens/{name}", 17, 20
                )
            # Every microbatch counted once: the phase trained what it planned, dealt out
            # within one microbatch (512 tokens) of each source's plan.
            assert supervised["trained_tokens"] == supervised["planned_tokens"] == 4 * 1024
            assert abs(replay["trained_tokens"] - replay["planned_tokens"]) <= 512
            assert 0 < summaries["target_tokens"] < summaries["trained_tokens"]  # padded rows
            assert ledger["trained_tokens"] == ledger["planned_tokens"]
            assert ledger["replay_tokens"] == replay["trained_tokens"]
            assert ledger["replay_share"] == replay["trained_tokens"] / ledger["trained_tokens"]
            assert replay["planned_tokens"] == round(4 * 1024 / 5)
            assert ledger["planned_replay_share"] == replay["planned_tokens"] / (RAMP * 512 + 4096)

        # --- the CLI: the ledger's table, and a run from the best checkpoint, which nobody
        # trains: the worker goes first (it would train the new run, even to its end)
        worker.stop()
        table = run_cli(["runs", "ledger", run_id], env={**env, "COLUMNS": "80"})
        assert all(len(line) <= 80 for line in table.splitlines()), table
        for word in ("phase / source", "pretrain", "summarization", "replay*", "8.19k"):
            assert word in table, table
        assert f"replay (*): {ledger['replay_tokens']:,} of {ledger['trained_tokens']:,}" in table
        create = ["runs", "create", str(tmp_path / "wf.json"), "--json"]
        tuned = json.loads(run_cli([*create, "--from-run", run_id, "--best", "pretrain"], env=env))
        assert tuned["initial_checkpoint_from"] == {"run": run_id, "step": best, "best": "pretrain"}
        shown = run_cli(["runs", "show", tuned["id"]], env=env)
        assert (
            f"initial checkpoint: run {run_id} step {best} (best of eval set 'pretrain')" in shown
        )
        run_cli(["runs", "cancel", tuned["id"]], env=env)
