"""The token store at scale: build throughput, phase start and memory, on corpora it generates.

For each corpus size (text tokens, with the demo tokenizer of examples/), in fresh processes so
that each peak RSS is the process's own:

- **baseline**: `tokenizers.Tokenizer.encode_batch` alone over the file's lines, in batches of
  the store's ENCODE_BATCH, with the same threads: the floor the store's build is held to;
- **fast baseline**: the same with `encode_batch_fast` (no character offsets), the call the
  store's encoder makes: what is left of the build's own work beside the tokenizer's;
- **build**: `worker.data.store.ensure_store` writing the store (reading, parsing, encoding,
  measuring every record, writing the maps), with its peak RSS;
- **start**: a phase start on the built store: the digest check of the data file
  (`runtime.digest.digest_path`, the stat cache) and `worker.data.batch.load_phase_data`, then the
  first 20 batches read from the maps, with the process's peak RSS;
- **inspection**: `worker.data.inspect.inspect_file` of the file from its built store, with its peak
  RSS;
- **old start** (sizes up to `--old-max`): what a phase start cost before the store, reading
  and encoding the whole corpus into Python objects (`encode_records` over `read_records`).

A supervised corpus (source/target pairs) is measured the same way at one size.

    .venv/bin/python bench/data_store.py [--sizes 1e6,1e7,1e8] [--old-max 1e7] [--pairs 4e6]

Prints a markdown table; writes only under a temporary directory, removed on exit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tokenizer" / "tokenizer.json"
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "rug",
    "red",
    "blue",
    "green",
    "quick",
    "slow",
    "model",
    "data",
    "token",
    "train",
    "loss",
    "step",
    "phase",
    "run",
    "worker",
    "store",
    "batch",
    "memory",
    "disk",
    "read",
    "write",
    "file",
    "line",
    "record",
    "test",
]
SEQ = 512
PAIR_SEQ = 256


# --- corpora --------------------------------------------------------------------------------


def tokens_per_word() -> float:
    """What the demo tokenizer makes of a word of WORDS, with its space, on a sample."""
    from tokenizers import Tokenizer

    sample = " ".join(random.Random(2).choices(WORDS, k=5000))
    return len(Tokenizer.from_file(str(TOKENIZER)).encode(sample).ids) / 5000


def write_text_corpus(path: Path, tokens: int) -> int:
    """JSONL documents of 120 to 280 words until about `tokens` tokens."""
    rng = random.Random(0)
    words = int(tokens / tokens_per_word())
    written = 0
    with path.open("w") as f:
        while written < words:
            n = rng.randint(120, 280)
            f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=n))}) + "\n")
            written += n
    return path.stat().st_size


def write_pairs_corpus(path: Path, tokens: int) -> int:
    rng = random.Random(1)
    written = 0
    words = tokens / tokens_per_word()
    with path.open("w") as f:
        while written < words:
            source = rng.choices(WORDS, k=rng.randint(15, 40))
            target = rng.choices(WORDS, k=rng.randint(5, 20))
            f.write(json.dumps({"source": " ".join(source), "target": " " + " ".join(target)}))
            f.write("\n")
            written += len(source) + len(target)
    return path.stat().st_size


# --- children: each measured in a process of its own ----------------------------------------


def child(mode: str, path: str, root: str, objective: str) -> dict[str, Any]:
    from worker.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    text = objective == "continued_pretrain"
    started = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before = usage.ru_utime + usage.ru_stime
    out: dict[str, Any] = {}
    if mode in ("baseline", "fast"):
        from worker.data.records import read_lines
        from worker.data.store import ENCODE_BATCH

        encode = tokenizer.encode_batch if mode == "baseline" else tokenizer.encode_batch_fast
        lines = []
        tokens = 0
        for _, line in read_lines(path):
            record = json.loads(line)
            # Every string the store's encoder encodes: the text, or a pair's source and target.
            lines += [record["text"]] if text else [record["source"], record["target"]]
            if len(lines) >= ENCODE_BATCH:
                tokens += sum(len(e.ids) for e in encode(lines))
                lines = []
        tokens += sum(len(e.ids) for e in encode(lines))
        out["tokens"] = tokens
    elif mode == "build":
        from worker.data.store import Stores

        stores = Stores(Path(root), tokenizer)
        store = stores.get(path, fit=None if text else PAIR_SEQ)
        out["tokens"] = store.tokens
    elif mode == "inspect":
        from contracts.jobs import InspectRequest
        from worker.data.inspect import inspect_file
        from worker.data.store import Stores

        request = InspectRequest(
            path=path,
            tokenizer=str(TOKENIZER),
            objective=objective,
            sequence_length=SEQ if text else PAIR_SEQ,
        )
        out["records"] = inspect_file(request, stores=Stores(Path(root), tokenizer)).records
    elif mode in ("start", "old"):
        from contracts.workflow import Phase
        from worker.data.batch import batch_for_step, load_phase_data
        from worker.data.store import Stores

        phase = Phase.model_validate(
            {
                "name": "bench",
                "objective": objective,
                "data": [{"path": path}],
                "sequence_length": SEQ if text else PAIR_SEQ,
                "microbatch_size": 8,
                "steps": 1000,
            }
        )
        if mode == "start":
            stores = Stores(Path(root), tokenizer)
            stores.key(path, None)  # the digest check of verify_inputs, from the stat cache
            data = load_phase_data(phase, tokenizer, stores=stores)
        else:
            from worker.data.encode import encode_records
            from worker.data.records import read_records

            records = read_records(path)
            encoded = encode_records(tokenizer, records, sequence_length=None if text else PAIR_SEQ)
            out["tokens"] = sum(len(e.ids) for e in encoded)
            data = None
        out["ready"] = time.perf_counter() - started
        if data is not None:
            for step in range(1, 21):
                batch_for_step(data, seed=0, phase_index=0, step=step, micro=0)
    out["seconds"] = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = usage.ru_utime + usage.ru_stime - cpu_before
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_child(mode: str, path: Path, root: Path, objective: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), str(root), objective],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} of {path} failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --- the bench ------------------------------------------------------------------------------


def measure(path: Path, objective: str, tmp: Path, *, old: bool, rounds: int) -> dict[str, Any]:
    """Baseline and build alternate `rounds` times (each build from scratch), so that load
    from elsewhere falls on both alike; the medians and the median of the rounds' ratios are
    kept, with CPU seconds (user + system, every thread), which load changes less."""
    root = tmp / f"tokens-{path.stem}"
    baselines, fasts, builds = [], [], []
    for _ in range(rounds):
        shutil.rmtree(root, ignore_errors=True)
        baselines.append(run_child("baseline", path, root, objective))
        fasts.append(run_child("fast", path, root, objective))
        builds.append(run_child("build", path, root, objective))
    if not rounds:  # memory and start only: one build, no baseline
        builds.append(run_child("build", path, root, objective))
        baselines.append({"seconds": math.nan, "cpu_s": math.nan})
        fasts.append({"seconds": math.nan, "cpu_s": math.nan})
    baseline = {k: statistics.median(b[k] for b in baselines) for k in ("seconds", "cpu_s")}
    fast = {k: statistics.median(b[k] for b in fasts) for k in ("seconds", "cpu_s")}
    build = {
        k: statistics.median(b[k] for b in builds) for k in ("seconds", "cpu_s", "peak_rss_mb")
    }
    build["tokens"] = builds[0]["tokens"]
    ratio = statistics.median(
        b["seconds"] / d["seconds"] for b, d in zip(baselines, builds, strict=True)
    )  # nan without a baseline
    fast_ratio = statistics.median(
        f["seconds"] / d["seconds"] for f, d in zip(fasts, builds, strict=True)
    )
    start = run_child("start", path, root, objective)
    inspect = run_child("inspect", path, root, objective)
    row = {
        "file_mb": path.stat().st_size / 2**20,
        "tokens": build["tokens"],
        "baseline_s": baseline["seconds"],
        "build_s": build["seconds"],
        "ratio": ratio,
        "cpu_ratio": baseline["cpu_s"] / build["cpu_s"],
        "fast_s": fast["seconds"],
        "fast_ratio": fast_ratio,
        "build_rss_mb": build["peak_rss_mb"],
        "start_s": start["ready"],
        "start_rss_mb": start["peak_rss_mb"],
        "inspect_s": inspect["seconds"],
        "inspect_rss_mb": inspect["peak_rss_mb"],
    }
    if old:
        before = run_child("old", path, root, objective)
        row.update(old_s=before["ready"], old_rss_mb=before["peak_rss_mb"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="text corpus sizes, in tokens")
    parser.add_argument("--old-max", type=float, default=1e7, help="largest size for old start")
    parser.add_argument("--pairs", type=float, default=4e6, help="supervised corpus, in tokens")
    parser.add_argument(
        "--rounds", type=int, default=1, help="baseline/build rounds per corpus (0: build only)"
    )
    parser.add_argument("--child", nargs=4, metavar=("MODE", "PATH", "ROOT", "OBJECTIVE"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    print(
        f"{os.cpu_count()} cores, tokenizers threads: {os.environ.get('RAYON_NUM_THREADS', 'all')}"
    )
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            path = Path(tmp) / f"text-{int(size)}.jsonl"
            write_text_corpus(path, int(size))
            rows.append(
                (
                    "text",
                    measure(
                        path,
                        "continued_pretrain",
                        Path(tmp),
                        old=size <= args.old_max,
                        rounds=args.rounds,
                    ),
                )
            )
            path.unlink()
        if args.pairs:
            path = Path(tmp) / f"pairs-{int(args.pairs)}.jsonl"
            write_pairs_corpus(path, int(args.pairs))
            rows.append(
                ("pairs", measure(path, "summarization", Path(tmp), old=True, rounds=args.rounds))
            )

    print(
        "| corpus | file | tokens | encode_batch alone | store build | build / encode_batch "
        "| same, CPU seconds | encode_batch_fast alone | build / encode_batch_fast "
        "| build peak RSS | phase start (store) | start peak RSS | inspection (store) "
        "| inspection peak RSS | phase start before | RSS before |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, r in rows:
        old = f"{r['old_s']:.1f} s | {r['old_rss_mb'] / 1024:.2f} GB" if "old_s" in r else "— | —"
        print(
            f"| {kind} | {r['file_mb']:.0f} MB | {r['tokens'] / 1e6:.1f} M | "
            f"{r['baseline_s']:.1f} s | {r['build_s']:.1f} s | {r['ratio']:.2f}x | "
            f"{r['cpu_ratio']:.2f}x | {r['fast_s']:.1f} s | {r['fast_ratio']:.2f}x | "
            f"{r['build_rss_mb']:.0f} MB | {r['start_s']:.2f} s | {r['start_rss_mb']:.0f} MB | "
            f"{r['inspect_s']:.2f} s | {r['inspect_rss_mb']:.0f} MB | {old} |"
        )


if __name__ == "__main__":
    main()
