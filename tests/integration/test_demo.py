"""`trainctl demo` of a post-training workflow: on the embedded stack, it starts from the final
checkpoint of the demo workflow's run, trained first when the home has none and reused after.

The demo and the post-training twin are cut to a few steps; the check is what the run starts
from: its initial checkpoint is the demo run's last, and its baseline on held-out pretraining
text is that checkpoint's perplexity, not random weights'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import ROOT, processes, short_demo_workflow, start_api

from cli.demo import run_demo
from runtime.path import resolve_paths

pytestmark = pytest.mark.integration

TWIN = ROOT / "examples" / "workflows" / "sft.original.small.json"


def short_start() -> dict[str, Any]:
    """The demo workflow cut to a few steps, evaluated on held-out pretraining text only."""
    doc = short_demo_workflow(pretrain_steps=6, sft_steps=3)
    doc["evals"] = [
        {**e, "every_steps": 100} for e in doc["evals"] if e["task"] == "continued_pretrain"
    ]
    return doc


def short_twin() -> dict[str, Any]:
    """sft.original.small.json's first supervised and replay phases, a few steps each."""
    doc = resolve_paths(json.loads(TWIN.read_text()), TWIN.parent)
    summarization, replay = doc["phases"][:2]
    doc["phases"] = [{**summarization, "steps": 3}, {**replay, "steps": 2}]
    doc["evals"] = [
        {**e, "every_steps": 100}
        for e in doc["evals"]
        if e["name"] in ("pretrain", "summarization")
    ]
    return doc


def test_a_post_training_demo_starts_from_the_demo_runs_final_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINCTL_TORCH_THREADS", "1")
    home, start = tmp_path / "home", short_start()

    first = run_demo(short_twin(), home=home, timeout=300, start=start)

    # The home had no demo run: the demo trained first, then the twin from its last checkpoint.
    assert first.start is not None and first.start["status"] == "succeeded", first.start
    assert first.run["status"] == "succeeded", first.run
    final = first.start["latest_checkpoint"]
    assert final["step"] == first.start["total_steps"]
    assert first.run["initial_checkpoint"] == final["path"]
    # Its step-0 baseline on held-out pretraining text (the same file, at the same 128
    # positions) is the demo run's final perplexity: the demo's weights, not random ones.
    assert first.evals is not None
    baseline = first.evals["tasks"]["pretrain"]["baseline"]
    assert baseline["step"] == 0
    demo_final = _eval_latest(home, first.start["id"])
    assert baseline["perplexity"] == pytest.approx(demo_final["perplexity"], rel=1e-5)

    # Again, on the same home: the demo run is reused, not trained a second time.
    second = run_demo(short_twin(), home=home, timeout=300, start=start)
    assert second.start is not None and second.start["id"] == first.start["id"]
    assert second.run["id"] != first.run["id"]
    assert second.run["initial_checkpoint"] == final["path"]


def _eval_latest(home: Path, run_id: str) -> dict[str, Any]:
    """The demo run's latest held-out pretraining evaluation, read from the stack's database
    through a fresh `trainctl up` (run_demo stopped its own)."""
    with processes() as procs:
        _, url = start_api(
            ["up", "--workers", "0"],
            env={"TRAINCTL_HOME": str(home)},
            log=home / "read.log",
            procs=procs,
        )
        token = (home / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
            tasks = api.get(f"/runs/{run_id}/eval").json()["tasks"]
    latest: dict[str, Any] = tasks["continued_pretrain"]["latest"]
    return latest
