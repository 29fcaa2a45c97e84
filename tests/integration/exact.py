"""Helpers for comparing runs bit for bit: the workflows the exactness tests train and the
final states they compare."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import httpx
import torch
from procs import DEMO, Proc, wait_for_run
from safetensors.torch import load_file

from runtime.path import resolve_paths

STEPS = 12


def workflow(objective: str, *, steps: int = STEPS) -> dict[str, Any]:
    """One phase of the demo model with dropout on, checkpoints every 4 steps."""
    doc = resolve_paths(json.loads(DEMO.read_text()), DEMO.parent)
    source = next(p for p in doc["phases"] if p["objective"] == objective)
    doc["model"]["config"]["attention_dropout"] = 0.1
    doc["checkpoint"] = {"every_steps": 4, "keep_last": 2}
    doc["evals"] = [{**e, "every_steps": 4} for e in doc["evals"] if e["task"] == objective]
    phase = {
        **source,
        "sequence_length": 64,
        "microbatch_size": 8,
        "steps": steps,
        "schedule": {"kind": "cosine", "warmup_steps": 4},
    }
    if objective != "continued_pretrain":
        # A supervised phase mixes packed records with replayed pretraining text at its own
        # geometry, two microbatches a step: exactness must hold for the whole data path.
        pretrain = next(p for p in doc["phases"] if p["objective"] == "continued_pretrain")
        phase["grad_accum"] = 2
        phase["data"] = [
            *source["data"],
            {
                "name": "replay",
                "path": pretrain["data"][0]["path"],
                "weight": 0.25,
                "objective": "continued_pretrain",
                "sequence_length": 128,
                "microbatch_size": 4,
            },
        ]
    doc["phases"] = [phase]
    return doc


def final_state(run: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    checkpoint = Path(run["latest_checkpoint"]["path"])
    assert run["latest_checkpoint"]["step"] == run["total_steps"]
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    return load_file(checkpoint / "model.safetensors"), optimizer


def shard_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint's `shards/` (torch.distributed.checkpoint), whole,
    read as one process reads them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = str(checkpoint / "shards")
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in stored.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every place where two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def series(api: httpx.Client, run_id: str) -> dict[str, Any]:
    return api.get(f"/runs/{run_id}/metrics", params={"names": "loss,lr,lr_muon"}).json()


def ledger_phases(api: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    phases = api.get(f"/runs/{run_id}/ledger").json()["phases"]
    assert all(s["target_tokens"] for p in phases for s in p["sources"]), phases
    return list(phases)


def assert_identical_runs(
    api: httpx.Client, resumed: dict[str, Any], reference: dict[str, Any]
) -> None:
    weights, optimizer = final_state(resumed)
    ref_weights, ref_optimizer = final_state(reference)
    assert differences(weights, ref_weights) == []
    assert differences(optimizer, ref_optimizer) == []
    # Every step's loss and learning rate, not only the end: no step lost, none done twice.
    assert series(api, resumed["id"]) == series(api, reference["id"])
    # And the token ledger: what each source trained, counted across the resume as without it.
    assert ledger_phases(api, resumed["id"]) == ledger_phases(api, reference["id"])
    assert resumed["signature"] == reference["signature"]


def reference_run(api: httpx.Client, body: dict[str, Any], worker: Proc) -> dict[str, Any]:
    created = api.post("/runs", json=body)
    assert created.status_code == 201, created.text
    run = wait_for_run(api, created.json()["id"], timeout=300, procs=[worker])
    assert run["status"] == "succeeded", run
    return run


def make_initial_checkpoint(path: Path, config: dict[str, Any]) -> Path:
    """A model directory built in its own process (no RNG stream shared with the test)."""
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = json.loads(sys.argv[2]); kind = cfg.pop('model_type')\n"
        "torch.manual_seed(7)\n"
        "AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg))"
        ".save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path), json.dumps(config)], check=True)
    return path
