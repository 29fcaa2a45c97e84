"""Training throughput: trainctl's training loop against a bare PyTorch loop.

Both train the same demo-sized llama (vocab 1024, hidden 64, intermediate 256, 2 layers, 4 heads)
on microbatches of 8 x 64 tokens with the same optimizers (Muon for the hidden matrices, AdamW
for the rest) and gradient clipping. trainctl runs `worker.train.loop.train_phase` as the worker
does (batches drawn from tokenized data, the learning-rate schedule, metrics, stop checks); the
bare loop reuses one batch of random ids already on the device, plain causal attention
(`attention_mask=None`), and reads the loss once per step. Rounds alternate between the two so
that drifts of the machine fall on both.

`--objective` picks trainctl's data; the bare loop is the same either way:

- `continued_pretrain` (the default): plain text, packed into full windows, no mask; the
  ratio is the cost of trainctl's loop itself.
- any supervised objective (`summarization`, ...): source/target pairs of 5 to 40 tokens,
  packed several to a row of 64 with the rest padded, under a 4-D block-diagonal causal mask
  with restarting position ids; the ratio is then the whole cost of packing and the mask. The
  fill (the share of positions that are not padding) of the timed steps' batches is printed
  too, and "non-pad tokens/s" counts only those positions.

Timing covers whole steps only: for trainctl from the metrics of its first step to those of its
last (startup, tokenization and the final checkpoint are outside), for the bare loop the same
number of steps after one warm-up step. Both count every position of the envelope as a token.

    .venv/bin/python bench/train_throughput.py [--objective summarization] [--rounds 5]
        [--steps 20] [--device cuda --size gpu [--peak-tflops 989]] [--rng-mode [--dropout 0.1]]

`--device cuda` trains both loops under bf16 autocast, as the worker does on a GPU; `--size gpu`
is a ~150M-parameter llama in 8 x 2048-token microbatches, and with a known device (or
`--peak-tflops`) the model FLOPs utilisation (MFU) of both is printed.

`--rng-mode` times something else: the bare loop's step with and without the private-RNG
function mode (`worker/model/rng.py`: `PrivateRandom.drawing()`, which the worker's loop wraps
around forward and backward), in interleaved rounds, and prints the ratio. The mode adds Python
work to every torch call; on a CPU that is lost in the op's own time, on a GPU it may not be.
`--dropout P` sets the model's attention dropout, so that the mode's own dropout (drawn from the
private generator, attention computed by its reference formula) is in the step too; without it
both loops compute the same thing. Runs anywhere: `--rng-mode --device cpu --size demo` in a
few seconds.

Prints a markdown table; writes nothing but temporary files (tokenizer, data, the phase's final
checkpoint) that are deleted on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM

from contracts.reports import CheckpointRef, Claim, EvalResult, RemovalStatus
from contracts.signature import Digests
from contracts.workflow import OBJECTIVES, Workflow
from worker.data.batch import batch_for_step, load_phase_data
from worker.data.tokenizer import load_tokenizer
from worker.link.reporter import Action
from worker.model.model import configure_determinism
from worker.model.optim import build_optimizers
from worker.model.rng import PrivateRandom
from worker.train.loop import train_phase


@dataclass(frozen=True)
class Setup:
    """The model and microbatch both loops train."""

    model: dict[str, Any]
    sequence_length: int
    microbatch_size: int

    @property
    def tokens(self) -> int:
        return self.sequence_length * self.microbatch_size

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x parameters of the matrices, plus attention's
        scores and values (forward 2 x 2 x layers x hidden x sequence, x3 with backward)."""
        m = self.model
        hidden, layers = m["hidden_size"], m["num_hidden_layers"]
        matrices = layers * (4 * hidden * hidden + 3 * hidden * m["intermediate_size"])
        matrices += m["vocab_size"] * hidden  # the head
        return 6.0 * matrices + 12.0 * layers * hidden * self.sequence_length


SIZES = {
    # The demo's scale: what 2 CPU cores train in seconds.
    "demo": Setup(
        model={
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
        },
        sequence_length=64,
        microbatch_size=8,
    ),
    # A GPU's: ~150M parameters in 16,384-token microbatches (8 x 2048), as the original
    # workflow's supervised phases.
    "gpu": Setup(
        model={
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 12,
            "num_attention_heads": 16,
            "max_position_embeddings": 2048,
        },
        sequence_length=2048,
        microbatch_size=8,
    ),
}
# Dense bf16 peak TFLOP/s by device name, for MFU; others need --peak-tflops.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}
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

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        return frozenset()  # held, nothing pinned

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        return True  # recorded: retention deletes as it would

    def check(self, step: int, *, now: bool = False) -> Action:
        return "continue"

    def progress(self) -> None:
        pass

    def preparing(self, file: str, fraction: float) -> None:
        pass


def write_inputs(folder: Path, objective: str, setup: Setup) -> tuple[Path, Path]:
    """The tokenizer, and the data of `objective`: 2000 documents of 60 words for pretraining,
    2000 pairs of 3-30 source and 1-9 target words for a supervised objective."""
    rng = random.Random(0)
    words = _TEXT.split()

    def phrase(low: int, high: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    texts = [phrase(60, 60) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=setup.model["vocab_size"],
            special_tokens=["<|pad|>", "<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer_path = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    if objective == "continued_pretrain":
        data_path = folder / "corpus.txt"
        data_path.write_text("\n".join(texts) + "\n")
    else:
        data_path = folder / "pairs.jsonl"
        pairs = [{"source": phrase(3, 30), "target": " " + phrase(1, 9)} for _ in range(2000)]
        data_path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return tokenizer_path, data_path


def make_workflow(
    tokenizer: Path, data: Path, objective: str, steps: int, setup: Setup
) -> Workflow:
    return Workflow.model_validate(
        {
            "name": "bench",
            "model": {"config": setup.model},
            "tokenizer": str(tokenizer),
            "microbatch_tokens": setup.tokens,
            "checkpoint": {"every_steps": 10**6},
            "phases": [
                {
                    "name": "bench",
                    "objective": objective,
                    "data": [{"path": str(data)}],
                    "sequence_length": setup.sequence_length,
                    "microbatch_size": setup.microbatch_size,
                    "steps": steps,
                }
            ],
        }
    )


def trainctl_tokens_per_s(
    workflow: Workflow, artifact_dir: Path, steps: int, device: torch.device
) -> float:
    claim = Claim(
        attempt_id="bench",
        run_id="bench",
        attempt_number=1,
        fencing_token="bench",
        lease_seconds=60,
        workflow=workflow.normalized(),
        signature="bench",
        digests=Digests(tokenizer="", data={}),
        phase_index=0,
        artifact_dir=str(artifact_dir),
    )
    reporter = TimingReporter()
    train_phase(claim=claim, workflow=workflow, reporter=reporter, device=device)
    elapsed = reporter.times[steps + 1] - reporter.times[1]
    return steps * workflow.phases[0].microbatch_tokens / elapsed


def batch_fill(workflow: Workflow, steps: int) -> tuple[float, float, float | None]:
    """(fill, target share, records per row) of the batches trainctl trains in the timed steps
    (phase steps 2 .. steps + 1): the shares of envelope positions that are not padding and
    that are targets. Records per row is None for text windows, which hold no records."""
    phase = workflow.phases[0]
    data = load_phase_data(phase, load_tokenizer(workflow.tokenizer))
    batches = [
        batch_for_step(data, seed=workflow.seed, phase_index=0, step=step, micro=micro)
        for step in range(2, steps + 2)
        for micro in range(phase.grad_accum)
    ]
    positions = sum(b.input_ids.numel() for b in batches)
    real = sum(int((b.input_ids != data.pad_id).sum()) for b in batches)
    targets = sum(b.target_tokens for b in batches)
    records = None
    if all(b.position_ids is not None for b in batches):
        # A record starts where its position id is 0; a padding position has 0 too.
        starts = sum(
            int(((b.position_ids == 0) & (b.input_ids != data.pad_id)).sum()) for b in batches
        )
        records = starts / sum(len(b.input_ids) for b in batches)
    return real / positions, targets / positions, records


def bare_tokens_per_s(
    workflow: Workflow,
    steps: int,
    setup: Setup,
    device: torch.device,
    *,
    private: PrivateRandom | None = None,
    dropout: float = 0.0,
) -> float:
    """The bare loop's tokens/s. With `private`, forward and backward run under its function
    mode, as the worker's loop runs them (clipping and the optimizer steps outside it)."""
    torch.manual_seed(0)
    config = {k: v for k, v in setup.model.items() if k != "model_type"}
    if dropout:
        config["attention_dropout"] = dropout
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config))
    model = model.to(device).train()
    optimizers = build_optimizers(model, workflow.optimizer)
    ids = torch.randint(
        0, setup.model["vocab_size"], (setup.microbatch_size, setup.sequence_length + 1)
    ).to(device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    cuda = device.type == "cuda"

    def step() -> None:
        with private.drawing() if private is not None else contextlib.nullcontext():
            # As worker.train.objective: the forward under bf16 autocast on CUDA, the loss in
            # float32.
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(input_ids=inputs, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
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
    return steps * setup.tokens / (time.perf_counter() - started)


def rng_mode(rounds: int, steps: int, setup: Setup, device: torch.device, dropout: float) -> None:
    """Print the bare step's tokens/s without and with the private-RNG function mode, in
    interleaved rounds, and the median ratio (with / without) on a line of its own."""
    workflow = Workflow.model_validate(
        {
            "name": "bench",
            "model": {"config": setup.model},
            "tokenizer": "unused",
            "microbatch_tokens": setup.tokens,
            "phases": [
                {
                    "name": "bench",
                    "objective": "continued_pretrain",
                    "data": [{"path": "unused"}],
                    "sequence_length": setup.sequence_length,
                    "microbatch_size": setup.microbatch_size,
                    "steps": steps,
                }
            ],
        }
    )
    rows = []
    for round_index in range(rounds):
        # Which goes first alternates, so that a drift of the machine falls on both.
        timed: dict[bool, float] = {}
        for with_mode in (False, True) if round_index % 2 == 0 else (True, False):
            private = PrivateRandom(workflow.seed, device) if with_mode else None
            timed[with_mode] = bare_tokens_per_s(
                workflow, steps, setup, device, private=private, dropout=dropout
            )
        rows.append((timed[False], timed[True], timed[True] / timed[False]))
    m = setup.model
    print(
        f"Private-RNG function mode, {_where(device)}: llama hidden {m['hidden_size']}, "
        f"{m['num_hidden_layers']} layers, microbatch {setup.microbatch_size} x "
        f"{setup.sequence_length} tokens, attention dropout {dropout:g}; {rounds} interleaved "
        f"rounds of {steps} steps of the bare loop, forward and backward without and with "
        "`PrivateRandom.drawing()`.\n"
    )
    print("| round | without the mode tokens/s | with the mode tokens/s | with / without |")
    print("|---:|---:|---:|---:|")
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    for label, (plain, mode, ratio) in [
        *((str(i), row) for i, row in enumerate(rows, start=1)),
        ("median", medians),
    ]:
        print(f"| {label} | {plain:,.0f} | {mode:,.0f} | {ratio:.3f} |")
    print(
        f"\nrng mode ratio (tokens/s with / without, median of rounds; below 1: the mode "
        f"slows the step): {medians[2]:.3f}"
    )


def _where(device: torch.device) -> str:
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name(device)}, bf16 autocast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="continued_pretrain",
        help="trainctl's data: text windows, or packed records for any other objective",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    parser.add_argument("--size", choices=sorted(SIZES), default="demo")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for MFU")
    parser.add_argument(
        "--rng-mode",
        action="store_true",
        help="time the bare step with and without the private-RNG function mode instead",
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout (--rng-mode)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    device, setup = torch.device(args.device), SIZES[args.size]
    # As the worker: deterministic on CPU; bf16 autocast on CUDA for both loops.
    configure_determinism(device)
    peak = args.peak_tflops
    if device.type == "cuda" and peak is None:
        name = torch.cuda.get_device_name(device)
        peak = next((tf for key, tf in PEAK_TFLOPS.items() if key in name), None)

    if args.rng_mode:
        rng_mode(args.rounds, args.steps, setup, device, args.dropout)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainctl-bench-") as tmp:
        folder = Path(tmp)
        tokenizer, data = write_inputs(folder, args.objective, setup)
        # One step more than timed: the interval runs from the first step's metrics to the last's.
        workflow = make_workflow(tokenizer, data, args.objective, args.steps + 1, setup)
        fill, target_share, records = batch_fill(workflow, args.steps)
        for round_index in range(args.rounds):
            run_dir = folder / f"run-{round_index}"
            ours = trainctl_tokens_per_s(workflow, run_dir, args.steps, device)
            bare = bare_tokens_per_s(workflow, args.steps, setup, device)
            rows.append((ours, ours * fill, bare, ours / bare, ours * fill / bare))

    m = setup.model
    print(
        f"Training throughput, {_where(device)}: llama vocab {m['vocab_size']}, hidden "
        f"{m['hidden_size']}, {m['num_hidden_layers']} layers, microbatch "
        f"{setup.microbatch_size} x {setup.sequence_length} tokens, Muon + AdamW; "
        f"{args.rounds} interleaved rounds of {args.steps} steps."
    )
    if records is None:
        print(f"trainctl: {args.objective}, text packed into full windows, no mask.")
    else:
        print(
            f"trainctl: {args.objective}, {records:.2f} records per row, 4-D block-diagonal "
            f"mask (one record per row would fill {fill / records:.3f}); the bare loop: random "
            "ids, no mask."
        )
    print(f"Fill (non-pad positions) {fill:.3f}, targets {target_share:.3f} of positions.\n")
    print(
        "| round | trainctl tokens/s | trainctl non-pad tokens/s | bare PyTorch tokens/s "
        "| trainctl / bare | non-pad / bare |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    for label, (ours, real, bare, ratio, real_ratio) in [
        *((str(i), row) for i, row in enumerate(rows, start=1)),
        ("median", medians),
    ]:
        rates = f"{ours:,.0f} | {real:,.0f} | {bare:,.0f}"
        print(f"| {label} | {rates} | {ratio:.3f} | {real_ratio:.3f} |")
    if peak is not None:
        # Model FLOPs utilisation: the FLOPs the model needs per token at the median rate,
        # against the device's dense bf16 peak.
        flops = setup.flops_per_token()
        mfu, bare_mfu = (medians[i] * flops / (peak * 1e12) for i in (0, 2))
        print(
            f"\nMFU at {flops / 1e9:.2f} GFLOP a token against {peak:g} TFLOP/s: trainctl "
            f"{mfu:.1%}, bare PyTorch {bare_mfu:.1%}"
        )


if __name__ == "__main__":
    main()
