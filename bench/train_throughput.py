"""Training throughput: trainctl's training loop against a bare PyTorch loop.

Both train the same demo-sized llama (vocab 1024, hidden 64, intermediate 256, 2 layers, 4 heads)
on microbatches of 8 x 64 tokens with the same optimizers (Muon for the hidden matrices, AdamW
for the rest) and gradient clipping. trainctl runs `worker.trainer.train_phase` as the worker
does (batches drawn from tokenized data, the learning-rate schedule, metrics, stop checks); the
bare loop reuses one batch already on the device and reads the loss once per step. Rounds
alternate between the two so that drifts of the machine fall on both.

Timing covers whole steps only: for trainctl from the metrics of its first step to those of its
last (startup, tokenization and the final checkpoint are outside), for the bare loop the same
number of steps after one warm-up step.

    .venv/bin/python bench/train_throughput.py [--rounds 5] [--steps 20]

Prints a markdown table; writes nothing but temporary files (tokenizer, data, the phase's final
checkpoint) that are deleted on exit.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM

from contracts.reports import CheckpointRef, Claim, EvalResult
from contracts.signature import Digests
from contracts.workflow import Workflow
from worker.model import configure_determinism
from worker.optim import build_optimizers
from worker.reporter import Action
from worker.trainer import train_phase

SEQUENCE_LENGTH = 64
MICROBATCH_SIZE = 8
MODEL: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}
_TEXT = (
    "the a model trains on tokens and learns to predict the next one from what came before "
    "while the optimizer updates weights with momentum and the schedule lowers the rate"
)


class TimingReporter:
    """Records when each step's metrics arrive; posts nothing."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.times[step] = time.perf_counter()

    def evals(self, results: Sequence[EvalResult]) -> None:
        pass

    def checkpoint(self, ref: CheckpointRef) -> bool:
        return True

    def check(self, step: int, *, now: bool = False) -> Action:
        return "continue"


def write_inputs(folder: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    words = _TEXT.split()
    texts = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=MODEL["vocab_size"],
            special_tokens=["<|pad|>", "<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer_path = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    data_path = folder / "corpus.txt"
    data_path.write_text("\n".join(texts) + "\n")
    return tokenizer_path, data_path


def make_workflow(tokenizer: Path, data: Path, steps: int) -> Workflow:
    return Workflow.model_validate(
        {
            "name": "bench",
            "model": {"config": MODEL},
            "tokenizer": str(tokenizer),
            "microbatch_tokens": SEQUENCE_LENGTH * MICROBATCH_SIZE,
            "checkpoint": {"every_steps": 10**6},
            "phases": [
                {
                    "name": "pretrain",
                    "objective": "continued_pretrain",
                    "data": [{"path": str(data)}],
                    "sequence_length": SEQUENCE_LENGTH,
                    "microbatch_size": MICROBATCH_SIZE,
                    "steps": steps,
                }
            ],
        }
    )


def trainctl_tokens_per_s(workflow: Workflow, artifact_dir: Path, steps: int) -> float:
    claim = Claim(
        attempt_id="bench",
        run_id="bench",
        attempt_number=1,
        fencing_token=1,
        lease_seconds=60,
        workflow=workflow.normalized(),
        signature="bench",
        digests=Digests(tokenizer="", data={}),
        phase_index=0,
        artifact_dir=str(artifact_dir),
    )
    reporter = TimingReporter()
    train_phase(claim=claim, workflow=workflow, reporter=reporter, device=torch.device("cpu"))
    elapsed = reporter.times[steps + 1] - reporter.times[1]
    return steps * SEQUENCE_LENGTH * MICROBATCH_SIZE / elapsed


def bare_tokens_per_s(workflow: Workflow, steps: int) -> float:
    torch.manual_seed(0)
    config = {k: v for k, v in MODEL.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config)).train()
    optimizers = build_optimizers(model, workflow.optimizer)
    ids = torch.randint(0, MODEL["vocab_size"], (MICROBATCH_SIZE, SEQUENCE_LENGTH + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers.muon.step()
        optimizers.adamw.step()
        optimizers.muon.zero_grad(set_to_none=True)
        optimizers.adamw.zero_grad(set_to_none=True)
        loss.item()

    step()  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * SEQUENCE_LENGTH * MICROBATCH_SIZE / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    # The worker trains on CPU deterministically; the bare loop runs under the same setting.
    configure_determinism(torch.device("cpu"))

    rows = []
    with tempfile.TemporaryDirectory(prefix="trainctl-bench-") as tmp:
        folder = Path(tmp)
        tokenizer, data = write_inputs(folder)
        # One step more than timed: the interval runs from the first step's metrics to the last's.
        workflow = make_workflow(tokenizer, data, args.steps + 1)
        for round_index in range(args.rounds):
            ours = trainctl_tokens_per_s(workflow, folder / f"run-{round_index}", args.steps)
            bare = bare_tokens_per_s(workflow, args.steps)
            rows.append((ours, bare, ours / bare))

    print(
        f"Training throughput, CPU, {torch.get_num_threads()} torch threads: llama vocab "
        f"{MODEL['vocab_size']}, hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} "
        f"layers, microbatch {MICROBATCH_SIZE} x {SEQUENCE_LENGTH} tokens, Muon + AdamW; "
        f"{args.rounds} interleaved rounds of {args.steps} steps.\n"
    )
    print("| round | trainctl tokens/s | bare PyTorch tokens/s | trainctl / bare |")
    print("|---:|---:|---:|---:|")
    for i, (ours, bare, ratio) in enumerate(rows, start=1):
        print(f"| {i} | {ours:,.0f} | {bare:,.0f} | {ratio:.3f} |")
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    print(f"| median | {medians[0]:,.0f} | {medians[1]:,.0f} | {medians[2]:.3f} |")


if __name__ == "__main__":
    main()
