"""A run's losses do not depend on what else the process draws from the global random streams.

The original PR's flaky test: dropout masks came from the backend's global RNG, which every
concurrently running test also drew from, so one model's masks depended on its neighbours.
Here a thread draws from a global stream (torch's, numpy's, Python's) for the whole of a
training phase, weight initialisation included; the phase's losses and final weights must be
bit-identical to a quiet run's. The data path draws from private numpy generators
(`worker.data.batch._epoch_rng`); initialisation and dropout from a private torch generator
(`worker.model.rng.PrivateRandom`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from contracts.reports import Claim
from contracts.workflow import Workflow
from worker.checkpoint.layout import MODEL_WEIGHTS
from worker.train.loop import train_phase

CPU = torch.device("cpu")


# The global streams a thread of the process may draw from, and how it draws.
GLOBAL_STREAMS: dict[str, Callable[[], object]] = {
    "numpy": np.random.random,
    "python": random.random,
    "torch": lambda: torch.rand(8),
}


@contextmanager
def drawing_from(stream: Callable[[], object]) -> Iterator[list[int]]:
    """A thread that draws from `stream` in a loop until the block ends; yields a one-element
    list counting its draws."""
    rounds = [0]
    done = threading.Event()

    def draw() -> None:
        while not done.is_set():
            stream()
            rounds[0] += 1

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield rounds
    finally:
        done.set()
        thread.join()


def train(workflow: Workflow, claim: Claim, reporter: Any) -> dict[str, torch.Tensor]:
    outcome = train_phase(claim=claim, workflow=workflow, reporter=reporter, device=CPU)
    assert outcome.status == "succeeded" and outcome.checkpoint is not None
    return load_file(Path(outcome.checkpoint.path) / MODEL_WEIGHTS)


@pytest.mark.parametrize("stream", GLOBAL_STREAMS)
def test_a_thread_drawing_from_a_global_rng_does_not_change_the_losses(
    stream: str,
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_reporter: Callable[..., Any],
    make_text_file: Callable[..., Path],
    make_pairs_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    # Dropout on, and a supervised mixture with replay: every random draw of a phase is made.
    workflow = make_workflow(
        [
            {
                "name": "sft",
                "objective": "instruction_tuning",
                "data": [
                    make_pairs_file(),
                    {
                        "path": str(make_text_file()),
                        "weight": 0.3,
                        "objective": "continued_pretrain",
                    },
                ],
                "steps": 6,
                "grad_accum": 2,
            }
        ],
        model={"attention_dropout": 0.3},
    )
    quiet_reporter = make_reporter()
    quiet = train(workflow, make_claim(workflow, artifact_dir=tmp_path / "a"), quiet_reporter)

    noisy_reporter = make_reporter()
    with drawing_from(GLOBAL_STREAMS[stream]) as rounds:
        noisy = train(workflow, make_claim(workflow, artifact_dir=tmp_path / "b"), noisy_reporter)
    assert rounds[0] > 0, "the thread drew meanwhile"

    losses = {s: m["loss"] for s, m in quiet_reporter.metrics_by_step.items()}
    assert {s: m["loss"] for s, m in noisy_reporter.metrics_by_step.items()} == losses
    assert quiet.keys() == noisy.keys()
    assert [n for n in quiet if not torch.equal(quiet[n], noisy[n])] == []
