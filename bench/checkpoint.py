"""Checkpoint cost: how long the training loop is blocked by an asynchronous checkpoint and how
long until it is durable, against `torch.save` + fsync of the same state and against the disk's
own bandwidth (`dd conv=fdatasync` of the same byte count).

The state is the demo model's (llama vocab 512, hidden 64, intermediate 256, 2 layers, 4 heads)
with Muon/AdamW state after a few steps, and the RNG. Rounds interleave the four measurements so
that drifts of the machine fall on all; each figure is the median over rounds.

    .venv/bin/python bench/checkpoint.py [--rounds 7]

Prints a markdown table; writes only temporary files, deleted on exit.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM

from contracts.workflow import OptimizerSpec
from worker.checkpoint.layout import CheckpointState
from worker.checkpoint.writer import CheckpointWriter
from worker.model.optim import build_optimizers
from worker.model.rng import PrivateRandom

MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **MODEL))
    optimizers = build_optimizers(model, OptimizerSpec())
    for _ in range(3):
        ids = torch.randint(0, 512, (4, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers.step()
        optimizers.zero_grad()
    tokenizer = Tokenizer(models.WordLevel({"<|pad|>": 0, "<|endoftext|>": 1}, unk_token="<|pad|>"))

    rng = PrivateRandom(0, torch.device("cpu"))
    blocked, durable, synchronous, dd = [], [], [], []
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as root:
        writer = CheckpointWriter(directory=Path(root) / "async", tokenizer=tokenizer)
        nbytes = 0
        for step in range(1, args.rounds + 2):  # the first round warms up, not counted
            state = CheckpointState(
                step=step,
                phase_index=0,
                phase_name="bench",
                phase_step=step,
                tokens_seen=0,
                signature="bench",
                attempt_id="bench",
                groups=optimizers.group_names(),
            )
            started = time.perf_counter()
            writer.start(model=model, optimizers=optimizers, state=state, rng=rng.state_dict())
            returned = time.perf_counter()
            saved = writer.wait()
            done = time.perf_counter()
            assert saved is not None
            nbytes = sum(p.stat().st_size for p in saved[1].rglob("*") if p.is_file())

            target = Path(root) / f"sync-{step}.pt"
            began = time.perf_counter()
            whole = {
                "model": model.state_dict(),
                "optimizer": optimizers.state_dict(),
                "rng": rng.state_dict(),
            }
            torch.save(whole, target)
            _fsync(target)
            ended = time.perf_counter()

            raw = Path(root) / f"dd-{step}"
            megabytes = max(1, round(nbytes / 2**20))
            dd_began = time.perf_counter()
            subprocess.run(
                [
                    "dd",
                    "if=/dev/zero",
                    f"of={raw}",
                    "bs=1M",
                    f"count={megabytes}",
                    "conv=fdatasync",
                ],
                check=True,
                capture_output=True,
            )
            dd_ended = time.perf_counter()
            target.unlink()
            raw.unlink()
            if step == 1:
                continue
            blocked.append(returned - started)
            durable.append(done - started)
            synchronous.append(ended - began)
            dd.append((dd_ended - dd_began) * nbytes / (megabytes * 2**20))
        writer.close()

    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    print(
        f"state: {nbytes / 2**20:.2f} MiB on disk; {args.rounds} rounds; {platform.machine()},"
        f" {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    print()
    print("| measurement | median ms | ratio to torch.save + fsync |")
    print("|---|---:|---:|")
    base = ms(synchronous)
    for name, xs in (
        ("loop blocked by an async checkpoint", blocked),
        ("async checkpoint durable (manifest, rename, fsync)", durable),
        ("torch.save + fsync of the same state", synchronous),
        ("dd conv=fdatasync of the same byte count", dd),
    ):
        print(f"| {name} | {ms(xs):.2f} | {ms(xs) / base:.3f} |")
    ratios = sorted(b / s for b, s in zip(blocked, synchronous, strict=True))
    own = sorted(b / d for b, d in zip(blocked, durable, strict=True))
    print()
    print(f"blocked / torch.save + fsync per round: {ratios[0]:.3f} .. {ratios[-1]:.3f}")
    print(
        "blocked / trainctl's own synchronous save (copy + write, = durable) per round: "
        f"{own[0]:.3f} .. {own[-1]:.3f}, median {statistics.median(own):.3f}"
    )


if __name__ == "__main__":
    main()
