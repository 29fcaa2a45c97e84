"""Checkpoint cost: how long the training loop is blocked by an asynchronous checkpoint and how
long until it is durable, on local disk and on an S3-compatible object store, against
`torch.save` + fsync of the same state and against the disk's own bandwidth (`dd
conv=fdatasync` of the same byte count).

- **local async**: `CheckpointWriter.start` (the snapshot: copy into reused CPU buffers; the
  loop's stall) until `wait` + `publish_checkpoint` (files written and fsynced, manifest,
  rename, directory fsync: durable).
- **object store async**: the same writer with `upload=RemoteCheckpoints.upload_files`, as the
  worker runs it on an `s3://` artifact root: the stall is the same snapshot; durable is until
  the background thread wrote the staging copy and uploaded every file, and the loop put the
  manifest (`RemoteCheckpoints.commit`, a create-only PUT) and renamed the staging copy into
  the local cache. Upload MiB/s is the bytes of the files over `upload_files`' time alone.
- **loop work**: a stand-in for training (256x256 matmuls, one after another) run while an
  object store save is in flight, its rate over the same work's with nothing in flight: what
  the background write and upload take from the loop beyond the stall (on 2 cores, with the
  S3 server on the same machine, a lot). Only for saves of a second or more (the large size):
  shorter windows measure the machine's noise.

Sizes: `demo` is the demo model's state (llama vocab 512, hidden 64, 2 layers; ~2 MiB);
`large` a llama of ~60M parameters built here on CPU (vocab 32000, hidden 512, intermediate
1536, 8 layers) whose weights + Muon/AdamW state after two steps on random tokens take 583 MiB
(611 MB) on disk.
Rounds interleave the four measurements so that drifts of the machine fall on all; each figure
is the median over rounds (the first round warms up and is not counted), each ratio the median
of the same-round ratios.

Without AWS_ENDPOINT_URL the bench starts its own loopback S3 server (moto in server mode, a
fresh bucket) and stops it at exit; with it set, it writes under `s3://<--bucket>/<prefix>/` of
that endpoint (real S3, MinIO) and deletes what it wrote.

    .venv/bin/python bench/checkpoint.py [--sizes demo,large] [--rounds 5] [--bucket NAME]

Prints one markdown table per size; writes only temporary files and objects, deleted on exit.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from contracts.workflow import OptimizerSpec
from runtime.store import join
from worker.checkpoint.layout import MANIFEST, CheckpointState
from worker.checkpoint.writer import CheckpointWriter, publish_checkpoint
from worker.model.optim import Optimizers, build_optimizers
from worker.model.rng import PrivateRandom
from worker.remote.checkpoints import RemoteCheckpoints

SIZES = {
    "demo": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    },
    # ~60M parameters: fp32 weights 240 MB, Muon momentum for the 27M hidden matrices, AdamW's
    # two moments for the 33M of embeddings and head: 583 MiB of checkpoint files.
    "large": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "max_position_embeddings": 256,
    },
}
STEPS = {"demo": 3, "large": 2}  # optimizer steps before the first checkpoint: state exists

ACCESS_KEY = "trainctl-bench"


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def object_store(bucket: str | None) -> Iterator[tuple[str, str]]:
    """An artifact root on an object store and a description of it. With AWS_ENDPOINT_URL set:
    a fresh prefix in `bucket` there. Otherwise a moto S3 server on a free loopback port, a
    fresh bucket in it and the AWS variables set in this process; the server is stopped on
    leaving (and at exit, should the bench die first)."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        if not bucket:
            sys.exit("AWS_ENDPOINT_URL is set: name the bucket to write into with --bucket")
        yield f"s3://{bucket}/trainctl-bench-{uuid.uuid4().hex[:8]}", os.environ["AWS_ENDPOINT_URL"]
        return
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(log.name)

    atexit.register(stop)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(
                        f"moto's S3 server did not start on {endpoint} (pip install "
                        f"'moto[server]'): {Path(log.name).read_text()[-2000:]}"
                    )
                time.sleep(0.2)
        name = bucket or f"bench-{uuid.uuid4().hex[:12]}"
        urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/{name}", method="PUT"), timeout=10
        ).close()
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": f"{ACCESS_KEY}-secret",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        yield f"s3://{name}/artifacts", f"moto {endpoint} (loopback, started by the bench)"
    finally:
        stop()


def build(size: str) -> tuple[PreTrainedModel, Optimizers]:
    """The model of `size` on CPU with optimizer state from a few steps on random tokens."""
    config = SIZES[size]
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **config)
    )
    optimizers = build_optimizers(model, OptimizerSpec())
    for _ in range(STEPS[size]):
        ids = torch.randint(0, config["vocab_size"], (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizers.step()
        optimizers.zero_grad()
    return model, optimizers


@dataclass
class Rounds:
    local_stall: list[float] = field(default_factory=list)
    local_durable: list[float] = field(default_factory=list)
    remote_stall: list[float] = field(default_factory=list)
    remote_durable: list[float] = field(default_factory=list)
    upload: list[float] = field(default_factory=list)  # seconds in upload_files
    loop_work: list[float] = field(default_factory=list)  # loop's work rate, save in flight / idle
    synchronous: list[float] = field(default_factory=list)
    dd: list[float] = field(default_factory=list)
    nbytes: int = 0  # the checkpoint's files on disk
    uploaded: int = 0  # the bytes upload_files puts (all files but the manifest)


def _work(a: torch.Tensor, b: torch.Tensor) -> None:
    """One unit of the loop's stand-in work: a 256x256 matmul, ~0.5 ms on a CPU core."""
    torch.mm(a, b)


def _rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    """Units of `_work` per second over `seconds` with nothing else of the bench running."""
    began, units = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        _work(a, b)
        units += 1
    return units / (time.perf_counter() - began)


def _state(step: int, optimizers: Optimizers) -> CheckpointState:
    return CheckpointState(
        step=step,
        phase_index=0,
        phase_name="bench",
        phase_step=step,
        tokens_seen=0,
        signature="bench",
        attempt_id="bench",
        groups=optimizers.group_names(),
    )


def measure(size: str, rounds: int, store_root: str, work: Path) -> Rounds:
    model, optimizers = build(size)
    tokenizer = Tokenizer(models.WordLevel({"<|pad|>": 0, "<|endoftext|>": 1}, unk_token="<|pad|>"))
    rng = PrivateRandom(0, torch.device("cpu"))
    remote = RemoteCheckpoints(join(store_root, "runs", f"bench-{size}-{uuid.uuid4().hex[:8]}"))
    upload_seconds: list[float] = []

    def upload(tmp: Path) -> None:
        began = time.perf_counter()
        remote.upload_files(tmp)
        upload_seconds.append(time.perf_counter() - began)

    local = CheckpointWriter(directory=work / "local", tokenizer=tokenizer)
    staged = CheckpointWriter(directory=work / "staging", tokenizer=tokenizer, upload=upload)
    out = Rounds()
    work_a, work_b = torch.randn(256, 256), torch.randn(256, 256)

    def save(step: int) -> dict[str, Any]:
        """`CheckpointWriter.start`'s arguments for a save of `step`."""
        state = _state(step, optimizers)
        return {"model": model, "optimizers": optimizers, "state": state, "rng": rng.state_dict()}

    try:
        for step in range(1, rounds + 2):  # the first round warms up, not counted
            # Local disk: snapshot (stall), background write, rename (durable).
            started = time.perf_counter()
            local.start(**save(step))
            returned = time.perf_counter()
            saved = local.wait()
            assert saved is not None
            final = publish_checkpoint(saved[1])
            done = time.perf_counter()
            files = [p for p in final.rglob("*") if p.is_file()]
            out.nbytes = sum(p.stat().st_size for p in files)
            out.uploaded = sum(p.stat().st_size for p in files if p.name != MANIFEST)
            shutil.rmtree(final)

            # Object store: snapshot (stall), background write + upload, manifest PUT and the
            # local cache's rename in the loop (durable).
            r_started = time.perf_counter()
            staged.start(**save(step))
            r_returned = time.perf_counter()
            saved = staged.wait()
            assert saved is not None
            if not remote.commit(saved[1]):
                raise SystemExit(f"{remote.uri(step)} existed before the bench committed it")
            cached = publish_checkpoint(saved[1])
            r_done = time.perf_counter()
            uploading = upload_seconds[-1]
            shutil.rmtree(cached)
            remote.delete(step)  # moto keeps what it holds in its process: keep it small

            # The loop's own work while an object store save is in flight, against the same
            # work with nothing in flight just before and just after: what the background
            # write and upload (and, on this machine, the S3 server) take from the loop beyond
            # the stall. Only where the save lasts a second or more: shorter windows measure
            # the machine's noise.
            window = min(3.0, r_done - r_started)
            if window >= 1.0:
                before = _rate(work_a, work_b, window)
                staged.start(**save(1000 + step))
                b_began, units = time.perf_counter(), 0
                while (saved := staged.poll()) is None:
                    _work(work_a, work_b)
                    units += 1
                in_flight = units / (time.perf_counter() - b_began)
                remote.commit(saved[1])
                shutil.rmtree(publish_checkpoint(saved[1]))
                remote.delete(1000 + step)
                after = _rate(work_a, work_b, window)
                if step > 1:
                    out.loop_work.append(2 * in_flight / (before + after))

            target = work / f"sync-{step}.pt"
            began = time.perf_counter()
            whole = {
                "model": model.state_dict(),
                "optimizer": optimizers.state_dict(),
                "rng": rng.state_dict(),
            }
            torch.save(whole, target)
            _fsync(target)
            ended = time.perf_counter()

            raw = work / f"dd-{step}"
            megabytes = max(1, round(out.nbytes / 2**20))
            dd_began = time.perf_counter()
            subprocess.run(
                ["dd", "if=/dev/zero", f"of={raw}", "bs=1M", f"count={megabytes}",
                 "conv=fdatasync"],
                check=True,
                capture_output=True,
            )  # fmt: skip
            dd_ended = time.perf_counter()
            target.unlink()
            raw.unlink()
            if step == 1:
                continue
            out.local_stall.append(returned - started)
            out.local_durable.append(done - started)
            out.remote_stall.append(r_returned - r_started)
            out.remote_durable.append(r_done - r_started)
            out.upload.append(uploading)
            out.synchronous.append(ended - began)
            out.dd.append((dd_ended - dd_began) * out.nbytes / (megabytes * 2**20))
            print(
                f"  {size} round {step - 1}: local {1000 * out.local_stall[-1]:.1f}/"
                f"{1000 * out.local_durable[-1]:.0f} ms, object store "
                f"{1000 * out.remote_stall[-1]:.1f}/{1000 * out.remote_durable[-1]:.0f} ms, "
                f"torch.save {1000 * out.synchronous[-1]:.0f} ms"
                + (
                    f", loop work in flight {out.loop_work[-1]:.2f} of idle"
                    if out.loop_work
                    else ""
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        local.close()
        staged.close()
    return out


def table(size: str, r: Rounds, rounds: int, store: str) -> str:
    ms = lambda xs: f"{statistics.median(xs) * 1000:.2f}"  # noqa: E731

    def ratio(xs: list[float]) -> str:
        each = sorted(x / s for x, s in zip(xs, r.synchronous, strict=True))
        return f"{statistics.median(each):.3f} ({each[0]:.3f}..{each[-1]:.3f})"

    rate = statistics.median(r.uploaded / 2**20 / s for s in r.upload)
    lines = [
        f"### {size}: {r.nbytes / 2**20:.2f} MiB on disk; {rounds} rounds; object store: {store}",
        "",
        "| path | loop stall ms | durable ms | upload MiB/s | stall / torch.save | "
        "durable / torch.save |",
        "|---|---:|---:|---:|---:|---:|",
        f"| local async (snapshot; write, fsync, manifest, rename) | {ms(r.local_stall)} | "
        f"{ms(r.local_durable)} | - | {ratio(r.local_stall)} | {ratio(r.local_durable)} |",
        f"| object store async (snapshot; write, upload, manifest PUT) | {ms(r.remote_stall)} | "
        f"{ms(r.remote_durable)} | {rate:.1f} (upload {ms(r.upload)} ms) | "
        f"{ratio(r.remote_stall)} | {ratio(r.remote_durable)} |",
        f"| torch.save + fsync (synchronous) | {ms(r.synchronous)} | {ms(r.synchronous)} | - | "
        "1.000 | 1.000 |",
        f"| dd conv=fdatasync, same bytes (synchronous) | {ms(r.dd)} | {ms(r.dd)} | - | "
        f"{ratio(r.dd)} | {ratio(r.dd)} |",
    ]
    if r.loop_work:
        lines += [
            "",
            "loop's work rate while an object store save is in flight (write + upload in the "
            "background), over its rate with none just before and after: median "
            f"{statistics.median(r.loop_work):.3f} ({min(r.loop_work):.3f}.."
            f"{max(r.loop_work):.3f})",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,large", help="comma-separated: demo, large")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds per size")
    parser.add_argument(
        "--bucket",
        help="with AWS_ENDPOINT_URL set: the bucket to write under (a fresh prefix, deleted "
        "after); without it, the name of the moto server's bucket (default: a fresh name)",
    )
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {unknown or 'empty'}; choose from {', '.join(SIZES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads"
    )
    with (
        object_store(args.bucket) as (root, store),
        tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".bench-checkpoint-") as work,
    ):
        for size in sizes:
            result = measure(size, args.rounds, root, Path(work))
            print()
            print(table(size, result, args.rounds, store), flush=True)


if __name__ == "__main__":
    main()
