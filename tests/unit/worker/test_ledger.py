"""The token ledger a phase reports: tokens, target tokens and epochs per source, cumulative
over the phase, and the same after a resume as without one."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from contracts.reports import Claim
from contracts.workflow import Workflow
from worker.checkpoint.layout import LEDGER, MANIFEST, STATE, read_state
from worker.data.batch import batch_for_step, load_phase_data
from worker.train.loop import train_phase

CPU = torch.device("cpu")
STEPS = 9


def mixture(
    make_workflow: Callable[..., Workflow],
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
    **checkpoint: Any,
) -> Workflow:
    """A supervised phase replaying pretraining text as a quarter of its tokens, two
    microbatches a step; few records and documents, so that both sources wrap into a second
    epoch."""
    phase = {
        "name": "sft",
        "objective": "instruction_tuning",
        "data": [
            make_pairs_file(records=30),
            {
                "path": str(make_text_file("replay.jsonl", documents=12)),
                "weight": 0.25,
                "objective": "continued_pretrain",
            },
        ],
        "steps": STEPS,
        "grad_accum": 2,
    }
    return make_workflow([phase], checkpoint=checkpoint or {"every_steps": 100, "keep_last": 2})


def ledger_points(metrics_by_step: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    prefixes = ("tokens/", "target_tokens/", "epochs/")
    return {
        step: {k: v for k, v in values.items() if k.startswith(prefixes)}
        for step, values in metrics_by_step.items()
    }


def test_the_ledger_counts_each_sources_tokens_targets_and_epochs(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
    tokenizer: Tokenizer,
) -> None:
    workflow = mixture(make_workflow, make_pairs_file, make_text_file)
    reporter = make_reporter()
    train_phase(claim=make_claim(workflow), workflow=workflow, reporter=reporter, device=CPU)

    # The same batches, built apart from the loop: what each source held, step by step.
    phase = workflow.phases[0]
    data = load_phase_data(phase, tokenizer)
    envelope = phase.microbatch_tokens
    tokens, targets = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    for step in range(1, STEPS + 1):
        for micro in range(phase.grad_accum):
            batch = batch_for_step(data, seed=workflow.seed, phase_index=0, step=step, micro=micro)
            tokens[batch.source] += envelope
            targets[batch.source] += batch.target_tokens
        points = reporter.metrics_by_step[step]
        assert [points["tokens/sft"], points["tokens/replay"]] == tokens.tolist()
        assert [points["target_tokens/sft"], points["target_tokens/replay"]] == targets.tolist()
    # Every microbatch is one source's, and all of them are counted.
    assert tokens.sum() == STEPS * phase.tokens_per_step
    # Every position of a text window is a target; padded supervised rows are not.
    assert targets[1] == tokens[1] and 0 < targets[0] < tokens[0]

    # Epochs: the replay text's windows read over those it holds; the records read over 30.
    text = data.sources[1]
    windows = int(tokens[1]) // text.geometry.sequence_length
    last = reporter.metrics_by_step[STEPS]
    assert last["epochs/replay"] == pytest.approx(windows / text.windows)  # type: ignore[union-attr]
    assert last["epochs/replay"] > 1 and last["epochs/sft"] > 1
    epochs = [reporter.metrics_by_step[s]["epochs/sft"] for s in range(1, STEPS + 1)]
    assert epochs == sorted(epochs) and epochs[0] > 0


def test_the_ledger_after_a_resume_equals_the_uninterrupted_runs_at_every_step(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = mixture(make_workflow, make_pairs_file, make_text_file, every_steps=4, keep_last=5)
    straight_reporter = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "a")
    train_phase(claim=claim, workflow=workflow, reporter=straight_reporter, device=CPU)
    mid = next(c for c in straight_reporter.checkpoints if c.step == 4)
    assert read_state(Path(mid.path)).source_target_tokens == {
        "sft": straight_reporter.metrics_by_step[4]["target_tokens/sft"],
        "replay": straight_reporter.metrics_by_step[4]["target_tokens/replay"],
    }

    random.seed(7)  # a fresh process: nothing carried over but the checkpoint
    resumed_reporter = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "b", resume_from=mid)
    train_phase(claim=claim, workflow=workflow, reporter=resumed_reporter, device=CPU)

    straight = ledger_points(straight_reporter.metrics_by_step)
    resumed = ledger_points(resumed_reporter.metrics_by_step)
    assert sorted(resumed) == list(range(5, STEPS + 1))
    assert len(resumed[5]) == 6  # three series for each of the two sources
    for step in resumed:
        assert resumed[step] == straight[step], step


def test_a_checkpoint_without_counts_resumes_and_reports_no_target_tokens(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_pairs_file: Callable[..., Path],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """A checkpoint an older worker wrote has no counts to go on from: the resumed phase says
    nothing about target tokens rather than counting from zero."""
    workflow = mixture(make_workflow, make_pairs_file, make_text_file, every_steps=4, keep_last=5)
    first = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "a")
    train_phase(claim=claim, workflow=workflow, reporter=first, device=CPU)
    mid = next(c for c in first.checkpoints if c.step == 4)
    # The counts are a part of their own: state.json is as an older worker writes and reads
    # it (strictly: it would refuse a key it does not know).
    directory = Path(mid.path)
    assert "source_target_tokens" not in json.loads((directory / STATE).read_text())
    # The checkpoint as an older worker wrote it: no ledger part, a manifest to match.
    (directory / LEDGER).unlink()
    manifest = json.loads((directory / MANIFEST).read_text())
    del manifest["files"][LEDGER]
    (directory / MANIFEST).write_text(json.dumps(manifest))

    resumed = make_reporter()
    claim = make_claim(workflow, artifact_dir=tmp_path / "b", resume_from=mid)
    train_phase(claim=claim, workflow=workflow, reporter=resumed, device=CPU)
    assert sorted(resumed.metrics_by_step) == list(range(5, STEPS + 1))
    assert not any(k.startswith("target_tokens/") for k in resumed.metrics_by_step[5])
    assert resumed.metrics_by_step[5]["tokens/sft"] == first.metrics_by_step[5]["tokens/sft"]
