"""A phase on two gloo ranks (worker.train.ranks, worker.process.launch) against the same phase on
one process: the math does not depend on the device count (to float-reduction order), a checkpoint
of two ranks resumes on one, and on the same count a resume is bit-identical to the uninterrupted
run.

The ranks are real processes (spawned, as the worker starts them) joined by gloo on this
machine; each runs `train_phase` with its `Ranks`, rank 0 with a reporter that writes what it
heard to a JSON file."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from contracts.reports import CheckpointRef, Claim, EvalResult, RemovalStatus
from contracts.signature import sha256_file
from contracts.workflow import Workflow
from worker.checkpoint.layout import MANIFEST, MODEL_WEIGHTS, RNG
from worker.checkpoint.shards import SHARDS, SHARDS_METADATA
from worker.link.reporter import SilentReporter
from worker.process.launch import free_port, run_ranks
from worker.train.loop import train_phase
from worker.train.ranks import Ranks

CPU = torch.device("cpu")
STEPS = 6


class FileReporter(SilentReporter):
    """Rank 0's reporter: losses by step, evals and the checkpoints registered, kept for the
    test; no order ever comes."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.eval_results: list[dict[str, Any]] = []
        self.removals: list[dict[str, Any]] = []

    def metrics(self, step: int, values: Mapping[str, float]) -> None:
        self.losses[step] = values["loss"]

    def evals(self, results: Sequence[EvalResult]) -> None:
        self.eval_results += [r.model_dump(mode="json") for r in results]

    def checkpoint(self, ref: CheckpointRef) -> frozenset[int] | None:
        self.checkpoints.append(ref.model_dump(mode="json"))
        return frozenset()

    def checkpoint_removed(self, step: int, status: RemovalStatus, reason: str) -> bool:
        self.removals.append({"step": step, "status": status, "reason": reason})
        return True  # recorded: retention deletes as it would


def record_hashing(hashed: list[str]) -> None:
    """From now on, append to `hashed` every file this process opens to hash
    (contracts.signature.sha256_file), from any module and thread."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and sys._getframe(1).f_code is sha256_file.__code__:
            hashed.append(str(args[0]))

    sys.addaudithook(hook)  # for the rest of this rank's process


def _rank(rank: int, world: int, port: int, claim_json: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        claim = Claim.model_validate_json(claim_json)
        workflow = Workflow.model_validate(claim.workflow)
        reporter = FileReporter() if rank == 0 else SilentReporter()
        hashed: list[str] = []
        if rank == 0:
            record_hashing(hashed)
        outcome = train_phase(
            claim=claim,
            workflow=workflow,
            reporter=reporter,
            device=CPU,
            ranks=Ranks(
                rank=rank,
                world=world,
                sharding=workflow.phase_resources(claim.phase_index).sharding,
            ),
        )
        if isinstance(reporter, FileReporter):
            assert outcome.checkpoint is not None
            Path(out).write_text(
                json.dumps(
                    {
                        "losses": reporter.losses,
                        "checkpoints": reporter.checkpoints,
                        "final": outcome.checkpoint.path,
                        "evals": reporter.eval_results,
                        "removals": reporter.removals,
                        "hashed": hashed,
                    }
                )
            )
    finally:
        dist.destroy_process_group()


def on_ranks(claim: Claim, world: int, out: Path) -> dict[str, Any]:
    mp.start_processes(
        _rank,
        args=(world, free_port(), claim.model_dump_json(), str(out)),
        nprocs=world,
        start_method="spawn",
    )
    result: dict[str, Any] = json.loads(out.read_text())
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def alone(claim: Claim) -> dict[str, Any]:
    torch.set_num_threads(1)
    workflow = Workflow.model_validate(claim.workflow)
    reporter = FileReporter()
    outcome = train_phase(claim=claim, workflow=workflow, reporter=reporter, device=CPU)
    assert outcome.checkpoint is not None
    return {
        "losses": reporter.losses,
        "checkpoints": reporter.checkpoints,
        "final": outcome.checkpoint.path,
        "evals": reporter.eval_results,
    }


def weights(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    return load_file(Path(result["final"]) / MODEL_WEIGHTS)


def mid(result: dict[str, Any], step: int) -> CheckpointRef:
    return CheckpointRef.model_validate(next(c for c in result["checkpoints"] if c["step"] == step))


def assert_within_float_order(
    actual: torch.Tensor, expected: torch.Tensor, lr: float, name: str
) -> None:
    """Weights trained on another device count, against one device's. Muon orthogonalises each
    update in bfloat16, where a last-bit difference of a float32 gradient can round a bf16
    element the other way: measured here after 6 steps, hidden weights differ by up to ~0.06
    of one update (lr per element; 1.1e-3 at lr 0.02) and by ~0.005 of one on average, the
    others by ~1e-5. A step that trained half the batch, or twice it, would be out by whole
    updates. So: no element further than a quarter of one update, and on average under a
    fiftieth (the largest difference depends on the CPU's kernels; one machine's 1.1e-3 failed
    a bound of 1e-3)."""
    difference = (actual - expected).abs()
    assert float(difference.max()) <= lr / 4, (name, float(difference.max()))
    assert float(difference.mean()) <= lr / 50, (name, float(difference.mean()))


def test_two_ranks_train_what_one_device_trains_and_resume_on_either_count(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
    make_pairs_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "mixture",
                "objective": "summarization",
                # Two sources: the per-source sums are gathered over ranks too.
                "data": [
                    make_pairs_file(),
                    {"path": str(make_text_file()), "objective": "continued_pretrain"},
                ],
                "steps": STEPS,
                "grad_accum": 4,
                "resources": {"devices": 2},
            }
        ],
        checkpoint={"every_steps": 3, "keep_last": 5},
        evals=[{"task": "summarization", "data": make_pairs_file("eval.jsonl"), "every_steps": 3}],
    )
    one = alone(make_claim(workflow, artifact_dir=tmp_path / "one"))
    two = on_ranks(make_claim(workflow, artifact_dir=tmp_path / "two"), 2, tmp_path / "two.json")

    # The same global batch: losses agree to float-reduction order, step by step. Weights move
    # further apart (assert_within_float_order).
    assert sorted(two["losses"]) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert math.isclose(two["losses"][step], one["losses"][step], rel_tol=1e-5), step
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for name in a:
        assert_within_float_order(b[name], a[name], workflow.optimizer.muon_lr, name)
    # Rank 0 alone evaluates and checkpoints: each once, as one device does.
    assert [c["step"] for c in two["checkpoints"]] == [3, 6]
    assert [e["step"] for e in two["evals"]] == [e["step"] for e in one["evals"]] == [0, 3, 6]

    # Pre-empted on two ranks, continued on two: bit for bit.
    again = on_ranks(
        make_claim(workflow, artifact_dir=tmp_path / "again", resume_from=mid(two, 3)),
        2,
        tmp_path / "again.json",
    )
    assert sorted(again["losses"]) == [4, 5, 6]
    assert all(again["losses"][s] == two["losses"][s] for s in (4, 5, 6))
    c = weights(again)
    assert all(torch.equal(c[name], b[name]) for name in b)

    # Pre-empted on two ranks, continued on one: the checkpoint holds the replicated state.
    fewer = alone(make_claim(workflow, artifact_dir=tmp_path / "fewer", resume_from=mid(two, 3)))
    assert sorted(fewer["losses"]) == [4, 5, 6]
    assert all(math.isclose(fewer["losses"][s], two["losses"][s], rel_tol=1e-5) for s in (4, 5))
    d = weights(fewer)
    for name in b:
        assert_within_float_order(d[name], b[name], workflow.optimizer.muon_lr, name)


def test_with_dropout_each_rank_draws_its_own_masks_and_a_resume_restores_every_rank_s(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": STEPS,
                "grad_accum": 2,
                "resources": {"devices": 2},
            }
        ],
        model={"attention_dropout": 0.3},
        checkpoint={"every_steps": 3, "keep_last": 5},
    )
    straight = on_ranks(make_claim(workflow, artifact_dir=tmp_path / "a"), 2, tmp_path / "a.json")
    # Rank 0's checkpoint holds both ranks' streams, and they are not the same stream.
    streams = torch.load(Path(mid(straight, 3).path) / RNG, weights_only=True)
    assert set(streams) == {"cpu", "rank1/cpu"}
    assert not torch.equal(streams["cpu"], streams["rank1/cpu"])

    resumed = on_ranks(
        make_claim(workflow, artifact_dir=tmp_path / "b", resume_from=mid(straight, 3)),
        2,
        tmp_path / "b.json",
    )
    assert all(resumed["losses"][s] == straight["losses"][s] for s in (4, 5, 6))
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_sharded_phase_trains_what_one_device_trains_and_its_checkpoints_load_anywhere(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
    make_pairs_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """FSDP2: each rank holds half of every block's parameters and optimizer state, and writes
    its own shards of them into the step directory (torch.distributed.checkpoint); the phase's
    final checkpoint also holds the model whole (save_pretrained-loadable). Every checkpoint
    resumes on one process as on two, and one device's on two sharded ranks."""
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": STEPS,
                "grad_accum": 2,
                "resources": {"devices": 2, "sharding": "fsdp"},
            }
        ],
        checkpoint={"every_steps": 3, "keep_last": 5},
        evals=[{"task": "summarization", "data": make_pairs_file("eval.jsonl"), "every_steps": 3}],
    )
    one = alone(make_claim(workflow, artifact_dir=tmp_path / "one"))
    two = on_ranks(make_claim(workflow, artifact_dir=tmp_path / "two"), 2, tmp_path / "two.json")
    # Measured ~1e-5 and not growing: Muon's orthogonalisation of a sharded matrix reduces
    # in another order (bfloat16) than of a whole one.
    for step in range(1, STEPS + 1):
        assert math.isclose(two["losses"][step], one["losses"][step], rel_tol=5e-5), step
    assert [e["step"] for e in two["evals"]] == [0, 3, 6]
    for a, b in zip(one["evals"], two["evals"], strict=True):
        assert math.isclose(a["cross_entropy"], b["cross_entropy"], rel_tol=5e-5)
    # Inside the phase, the model and the optimizers' sharded state are in one shard file per
    # rank, listed by the manifest (written last); at its end, the model is whole too, loadable
    # by plain transformers.
    inside, final = Path(mid(two, 3).path), Path(two["final"])
    assert sorted(p.name for p in (inside / SHARDS).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (inside / MODEL_WEIGHTS).exists()
    listed = json.loads((inside / MANIFEST).read_text())["files"]
    assert {f"{SHARDS}/__0_0.distcp", f"{SHARDS}/__1_0.distcp", SHARDS_METADATA} <= set(listed)
    assert (final / SHARDS_METADATA).is_file() and (final / MODEL_WEIGHTS).is_file()
    a, b = weights(one), weights(two)
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    loaded = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], b["lm_head.weight"])

    again = on_ranks(
        make_claim(workflow, artifact_dir=tmp_path / "again", resume_from=mid(two, 3)),
        2,
        tmp_path / "again.json",
    )
    assert all(again["losses"][s] == two["losses"][s] for s in (4, 5, 6))
    c = weights(again)
    assert all(torch.equal(c[name], b[name]) for name in b)

    # Resharded: two ranks' shards read whole by one process, and one device's whole
    # checkpoint sharded over two ranks.
    fewer = alone(make_claim(workflow, artifact_dir=tmp_path / "fewer", resume_from=mid(two, 3)))
    assert all(math.isclose(fewer["losses"][s], two["losses"][s], rel_tol=5e-5) for s in (4, 5))
    more = on_ranks(
        make_claim(workflow, artifact_dir=tmp_path / "more", resume_from=mid(one, 3)),
        2,
        tmp_path / "more.json",
    )
    assert all(math.isclose(more["losses"][s], one["losses"][s], rel_tol=5e-5) for s in (4, 5))


def test_each_rank_hashes_the_shards_it_wrote_and_a_corrupt_one_is_found_on_resume(
    make_workflow: Callable[..., Workflow],
    make_claim: Callable[..., Claim],
    make_text_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """Rank 0 never reads another rank's shards: hashing hundreds of GB alone, at each save
    and at each resume, it outlasted the others' wait in a collective. Each rank hashes the
    shard files it wrote once its DCP save is done, and on resume verifies the ones it reads;
    rank 0 gathers the digests into the manifest, and the verdicts."""
    workflow = make_workflow(
        [
            {
                "name": "pretrain",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 4,
                "grad_accum": 2,
                "resources": {"devices": 2, "sharding": "fsdp"},
            }
        ],
        checkpoint={"every_steps": 2, "keep_last": 5},
    )
    two = on_ranks(make_claim(workflow, artifact_dir=tmp_path / "two"), 2, tmp_path / "two.json")
    theirs = f"/{SHARDS}/__1_"
    assert [f for f in two["hashed"] if theirs in f] == []
    # The manifest still lists every shard file with its SHA-256, as one process reads it.
    for step in (2, 4):
        path = Path(mid(two, step).path)
        listed = json.loads((path / MANIFEST).read_text())["files"]
        shards = {
            f"{SHARDS}/{p.name}": {"sha256": sha256_file(p), "size": p.stat().st_size}
            for p in (path / SHARDS).iterdir()
        }
        assert len(shards) == 3 and {name: listed[name] for name in shards} == shards

    # Rank 1's shard of the final checkpoint, corrupted: rank 1 finds it, rank 0 quarantines
    # the checkpoint and the run continues from step 2, bit for bit.
    damaged = Path(two["final"]) / SHARDS / "__1_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = on_ranks(
        make_claim(workflow, artifact_dir=tmp_path / "again", resume_from=mid(two, 4)),
        2,
        tmp_path / "again.json",
    )
    [removal] = again["removals"]
    assert (removal["step"], removal["status"]) == (4, "quarantined")
    assert f"{SHARDS}/__1_0.distcp has SHA-256" in removal["reason"]
    assert sorted(again["losses"]) == [3, 4]
    assert all(again["losses"][s] == two["losses"][s] for s in (3, 4))
    assert [f for f in again["hashed"] if theirs in f] == []


def fail_first_on_rank_1(device: torch.device, workdir: Path) -> None:
    """A rank's work (worker.process.launch.run_ranks): rank 1 runs out of memory and is slow to
    go (a process freeing a device's memory); rank 0, waiting for it in a collective, fails
    after it but is gone first."""
    if dist.get_rank() == 0:
        dist.barrier()  # fails once rank 1 has left the group
        return
    # Slow to go: the interpreter waits at exit for this thread, until the parent ends it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=threading.Event().wait, args=(60,)).start()
    raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")


def test_a_failure_is_reported_as_the_first_rank_to_fail_not_the_lowest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's collective error, after rank 1's out-of-memory, must not hide it: the ranks
    are ordered by when they failed, not by number nor by when they were seen to end."""
    monkeypatch.setenv("TRAINCTL_DEVICE", "cpu")
    monkeypatch.setenv("TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS", "60")
    value, failure = run_ranks(
        fail_first_on_rank_1,
        2,
        (),
        workdir=tmp_path,
        stop_requested=lambda: False,
        handed_over=lambda: None,
    )
    assert value is None and failure is not None
    assert failure.rank == 1, failure.message
    assert failure.message.startswith("rank 1 of 2 "), failure.message
    assert "OutOfMemoryError: CUDA out of memory (injected on rank 1)" in failure.message
    # And its cause: an out-of-memory is `oom` (not retried), as on one device.
    assert failure.cause == "oom"
