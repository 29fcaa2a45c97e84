"""Post-training end to end: the example SFT workflow, cut short, on a real stack.

Replay inside supervised phases, segmented RAG records and chat data go through `trainctl
serve` on Postgres and a Celery worker on Redis; the per-source metrics, the eval summary and an
inspection gate are read back through the API.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from procs import Stack, processes, wait_for_run

from runtime.path import resolve_paths

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "workflows" / "sft.example.json"


def short_sft_workflow(**qa_changes: Any) -> dict[str, Any]:
    """Pretraining, then the QA (segmented RAG + replay) and instruction (chat + pairs +
    replay) phases of the example, a few steps each."""
    doc = resolve_paths(json.loads(EXAMPLE.read_text()), EXAMPLE.parent)
    pretrain, _, instruction, qa, _ = doc["phases"]
    doc["phases"] = [
        {**pretrain, "steps": 8, "schedule": {"kind": "wsd", "warmup_steps": 1}},
        {**qa, "steps": 8, "schedule": {"kind": "cosine", "warmup_steps": 1}, **qa_changes},
        {**instruction, "steps": 8, "schedule": {"kind": "cosine", "warmup_steps": 1}},
    ]
    doc["checkpoint"] = {"every_steps": 8, "keep_last": 2}
    doc["evals"] = [{**e, "every_steps": 4} for e in doc["evals"]]
    return doc


def test_replay_and_rag_records_train_and_report_per_source(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": short_sft_workflow()})
            assert created.status_code == 201, created.text
            planned = created.json()["plan"]
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
            assert run["status"] == "succeeded", run
            metrics = api.get(f"/runs/{run['id']}/metrics").json()
            evals = api.get(f"/runs/{run['id']}/eval").json()["tasks"]
            short = api.get(f"/runs/{run['id']}/eval", params={"max_points": 2}).json()["tasks"]

    # The plan names each source with its share; replay is a quarter of each SFT phase.
    qa_plan = planned["phases"][1]
    assert [s["name"] for s in qa_plan["sources"]] == ["qa_rag", "replay"]
    assert qa_plan["replay_token_share"] == pytest.approx(0.25)
    # A quarter of the 16 supervised steps' tokens, after 8 steps of pretraining.
    assert planned["post_training_replay_share"] == pytest.approx(0.25)
    assert planned["replay_token_share"] == pytest.approx(4 / 24)

    # Steps 9-16 (QA) and 17-24 (instruction): per-source loss in the steps holding a
    # microbatch of the source, and the realised share of replay after each phase.
    replay = dict(
        zip(metrics["loss/replay"]["steps"], metrics["loss/replay"]["values"], strict=True)
    )
    rag = dict(zip(metrics["loss/qa_rag"]["steps"], metrics["loss/qa_rag"]["values"], strict=True))
    assert set(replay) | set(rag) >= set(range(9, 17))
    assert set(replay) and all(9 <= s <= 24 for s in replay)
    assert all(math.isfinite(v) for v in [*replay.values(), *rag.values()])
    share = dict(
        zip(
            metrics["token_share/replay"]["steps"],
            metrics["token_share/replay"]["values"],
            strict=True,
        )
    )
    for last_step in (16, 24):  # within one microbatch (of 8) of the planned quarter
        assert abs(share[last_step] - 0.25) <= 1 / 8
    assert set(metrics["token_share/chat"]["steps"]) == set(range(17, 25))

    # Evals: every point names its phase; RAG records too long even without passages are
    # skipped and counted, the same number at every step; the history can be downsampled.
    qa = evals["qa_reasoning"]
    assert qa["baseline"]["step"] == 0 and qa["baseline"]["phase"] == "pretrain"
    assert {p["phase"] for p in qa["history"]} == {"pretrain", "sft_qa", "sft_instruction"}
    assert {p["oversized_records"] for p in qa["history"]} == {3}
    assert qa["latest"]["perplexity"] < qa["baseline"]["perplexity"]
    assert [p["step"] for p in short["qa_reasoning"]["history"]] == [0, 24]


def test_a_phase_whose_data_fails_its_inspection_gate_does_not_start(
    tmp_path: Path, postgres_url: str
) -> None:
    # Over a quarter of the RAG records fit only by dropping passages: a 5 % limit stops the phase.
    doc = short_sft_workflow(inspection={"max_trimmed_share": 0.05})
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=procs)
    assert run["status"] == "failed" and run["cause"] == "data", run
    assert "qa_rag.train.jsonl" in run["message"] and "max_trimmed_share" in run["message"]
    assert run["step"] == 8  # pretraining finished; the QA phase took no step
