from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from contracts.signature import sha256_file
from contracts.workflow import OptimizerSpec, Workflow
from worker.checkpoint.layout import (
    MANIFEST,
    MODEL_WEIGHTS,
    OPTIMIZER,
    RNG,
    STATE,
    CheckpointState,
    select_expired,
    temporary_name,
    verify_checkpoint,
)
from worker.checkpoint.resume import find_latest_complete, load_checkpoint
from worker.checkpoint.shards import SHARDS, ShardedSave
from worker.checkpoint.writer import (
    CheckpointWriter,
    CpuBuffers,
    publish_checkpoint,
    save_checkpoint,
    snapshot,
    write_temporary,
)
from worker.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from worker.error import CheckpointError
from worker.model.model import build_model, load_weights
from worker.model.optim import Optimizers, build_optimizers
from worker.model.rng import PrivateRandom


@pytest.fixture
def workflow(
    make_workflow: Callable[..., Workflow], make_text_file: Callable[..., Path]
) -> Workflow:
    return make_workflow(
        [{"name": "pt", "objective": "continued_pretrain", "data": [make_text_file()], "steps": 9}]
    )


def trained(workflow: Workflow) -> tuple[PreTrainedModel, Optimizers]:
    model = build_model(workflow, torch.device("cpu"))
    optimizers = build_optimizers(model, OptimizerSpec())
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizers.step()
    optimizers.zero_grad()
    return model, optimizers


def state_at(step: int, optimizers: Optimizers) -> CheckpointState:
    return CheckpointState(
        step=step,
        phase_index=0,
        phase_name="pt",
        phase_step=step,
        tokens_seen=128 * step,
        signature="sig",
        attempt_id="attempt-1",
        groups=optimizers.group_names(),
    )


def save(
    directory: Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    optimizers: Optimizers,
    rng: PrivateRandom | None = None,
) -> Path:
    rng = rng or PrivateRandom(0, torch.device("cpu"))
    return save_checkpoint(
        directory=directory,
        model=model,
        tokenizer=tokenizer,
        optimizers=optimizers,
        state=state_at(step, optimizers),
        rng=rng.state_dict(),
    )


def test_checkpoint_roundtrip_restores_every_part(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    rng = PrivateRandom(11, torch.device("cpu"))
    torch.rand(5, generator=rng.generator("cpu"))  # somewhere along its stream
    path = save(tmp_path / "checkpoints", 3, model, tokenizer, optimizers, rng)
    expected_draws = torch.rand(3, generator=rng.generator("cpu"))

    assert path == tmp_path / "checkpoints" / "step-00000003"
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-00000003"]  # no temporaries
    loaded = load_checkpoint(path)
    assert loaded.state == state_at(3, optimizers)

    fresh = build_model(workflow, torch.device("cpu"))
    load_weights(fresh, path)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    restored = build_optimizers(fresh, OptimizerSpec())
    restored.load_state_dict(loaded.optimizer)
    params = dict(fresh.named_parameters())
    for name in optimizers.adamw_names:
        assert torch.equal(
            restored.adamw.state[params[name]]["exp_avg_sq"],
            optimizers.adamw.state[dict(model.named_parameters())[name]]["exp_avg_sq"],
        )

    resumed = PrivateRandom(0, torch.device("cpu"))
    assert resumed.load_state_dict(loaded.rng) == []
    assert torch.equal(torch.rand(3, generator=resumed.generator("cpu")), expected_draws)


def test_parts_load_without_unpickling_code(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    path = save(tmp_path, 1, model, tokenizer, optimizers)
    for part in (OPTIMIZER, RNG):
        torch.load(
            path / part, weights_only=True
        )  # raises on anything but tensors and plain values
    state = json.loads((path / STATE).read_text())
    assert state["groups"] == {"muon": optimizers.muon_names, "adamw": optimizers.adamw_names}


def test_step_directory_loads_with_plain_transformers(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    path = save(tmp_path, 5, model, tokenizer, optimizers)

    plain = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    auto = AutoTokenizer.from_pretrained(path)
    assert auto.eos_token == EOS_TOKEN and auto.eos_token_id == tokenizer.token_to_id(EOS_TOKEN)
    assert auto.pad_token == PAD_TOKEN and auto.pad_token_id == tokenizer.token_to_id(PAD_TOKEN)
    text = "the cat sat on the mat"
    assert (
        auto(text, add_special_tokens=False).input_ids
        == tokenizer.encode(text, add_special_tokens=False).ids
    )


def test_manifest_lists_every_file_and_detects_a_corrupted_one(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    older = save(tmp_path, 1, model, tokenizer, optimizers)
    newer = save(tmp_path, 2, model, tokenizer, optimizers)
    manifest = json.loads((newer / MANIFEST).read_text())
    on_disk = sorted(p.relative_to(newer).as_posix() for p in newer.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != MANIFEST]
    verify_checkpoint(newer)
    assert find_latest_complete(tmp_path) == newer

    weights = newer / MODEL_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{MODEL_WEIGHTS} has SHA-256"):
        verify_checkpoint(newer)
    with pytest.raises(CheckpointError):
        load_checkpoint(newer)
    assert find_latest_complete(tmp_path) == older


def test_a_checkpoint_without_manifest_is_incomplete(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    older = save(tmp_path, 1, model, tokenizer, optimizers)
    newer = save(tmp_path, 2, model, tokenizer, optimizers)
    (newer / MANIFEST).unlink()  # as if killed before the manifest was written
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(newer)
    assert find_latest_complete(tmp_path) == older
    (older / RNG).unlink()
    assert find_latest_complete(tmp_path) is None


def test_saving_a_step_again_never_replaces_the_existing_checkpoint(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    # The step directory may belong to the attempt that replaced this one (a revived zombie
    # saving late): it is kept, byte for byte, and the late copy discarded.
    model, optimizers = trained(workflow)
    directory = tmp_path / "checkpoints"
    first = save(directory, 4, model, tokenizer, optimizers)
    before = (first / MODEL_WEIGHTS).read_bytes()
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    second = save(directory, 4, model, tokenizer, optimizers)
    assert first == second
    verify_checkpoint(second)
    assert (second / MODEL_WEIGHTS).read_bytes() == before
    assert [p.name for p in directory.iterdir()] == ["step-00000004"]


def test_a_step_directory_that_is_not_this_runs_step_is_quarantined_not_overwritten(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    directory = tmp_path / "checkpoints"
    other = save(directory, 2, model, tokenizer, optimizers)
    in_the_way = directory / "step-00000004"
    other.rename(in_the_way)  # complete, but of step 2
    saved = save(directory, 4, model, tokenizer, optimizers)
    assert saved == in_the_way
    assert load_checkpoint(saved).state.step == 4
    (quarantined,) = directory.glob("step-00000004.corrupt-*")
    assert load_checkpoint(quarantined).state.step == 2


def test_a_background_save_writes_only_its_own_temporary_directory(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    model, optimizers = trained(workflow)
    directory = tmp_path / "checkpoints"
    writer = CheckpointWriter(directory=directory, tokenizer=tokenizer)
    rng = PrivateRandom(0, torch.device("cpu"))
    writer.start(
        model=model, optimizers=optimizers, state=state_at(3, optimizers), rng=rng.state_dict()
    )
    saved = writer.wait()
    writer.close()
    assert saved is not None
    state, tmp = saved
    assert state.step == 3 and tmp.name.startswith(".tmp-step-00000003-")
    verify_checkpoint(tmp)
    assert [p.name for p in directory.iterdir()] == [tmp.name]  # nothing put in place
    assert publish_checkpoint(tmp) == directory / "step-00000003"
    assert [p.name for p in directory.iterdir()] == ["step-00000003"]


def test_retention_keeps_the_newest_and_each_phase_final(tmp_path: Path) -> None:
    for step in range(1, 10):
        (tmp_path / f"step-{step:08d}").mkdir()
    expired = select_expired(tmp_path, keep_last=2, keep_steps=[3, 6])
    assert [(s, p.name) for s, p in expired] == [(s, f"step-{s:08d}") for s in (7, 5, 4, 2, 1)]
    assert len(list(tmp_path.iterdir())) == 9  # deleted by the caller, once reported


def test_retention_ignores_leftovers_newer_than_the_registered_step(tmp_path: Path) -> None:
    for step in (2, 4, 6, 9, 10):
        (tmp_path / f"step-{step:08d}").mkdir()
    # 9 and 10 were written by an attempt that died before registering them; 6 was just
    # registered by the attempt that resumed from 4.
    expired = select_expired(tmp_path, keep_last=2, newest=6)
    assert [p.name for _, p in expired] == ["step-00000002"]


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_loading_a_checkpoint_is_progress_for_every_chunk_it_hashes(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer
) -> None:
    """A large checkpoint takes minutes to verify: each MiB hashed tells the lease keeper the
    worker is not hung."""
    model, optimizers = trained(workflow)
    path = save(tmp_path / "checkpoints", 3, model, tokenizer, optimizers)
    # A part of 2.5 MiB beside the small ones, listed in the manifest as any part is.
    big = path / "extra.bin"
    big.write_bytes(bytes(range(256)) * (10 * 1024))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["extra.bin"] = {"sha256": sha256_file(big), "size": big.stat().st_size}
    (path / MANIFEST).write_text(json.dumps(manifest))

    progress = Counter()
    load_checkpoint(path, progress=progress)
    chunks = [math.ceil(f["size"] / 2**20) for f in manifest["files"].values()]
    assert progress.calls == sum(chunks)
    assert math.ceil(big.stat().st_size / 2**20) == 3


def test_a_sharded_save_fsyncs_its_shards_directory_before_the_manifest(
    tmp_path: Path, workflow: Workflow, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards' names are entries of `shards/`: without an fsync of that directory a power
    loss after the rename may leave a published checkpoint whose manifest lists shards that
    are gone."""
    model, optimizers = trained(workflow)
    tmp = tmp_path / "checkpoints" / temporary_name(4)
    shards = tmp / SHARDS
    shards.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):  # as every rank's DCP wrote them
        (shards / name).write_bytes(name.encode())
    written: Future[dict[str, dict[str, object]]] = Future()
    written.set_result(
        {
            f"{SHARDS}/{p.name}": {"sha256": sha256_file(p), "size": p.stat().st_size}
            for p in shards.iterdir()
        }
    )
    copy = snapshot(
        model=model,
        optimizers=optimizers,
        state=state_at(4, optimizers),
        rng=PrivateRandom(0, torch.device("cpu")).state_dict(),
        buffers=CpuBuffers(),
        sharded=ShardedSave(tmp, written, optimizers.state_dict(), None),
    )
    synced: list[tuple[Path, bool]] = []  # (what was fsynced, whether the manifest existed)
    fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append((Path(os.readlink(f"/proc/self/fd/{fd}")), (tmp / MANIFEST).exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    assert write_temporary(directory=tmp.parent, snapshot=copy, tokenizer=tokenizer) == tmp
    assert (shards, False) in synced
    verify_checkpoint(tmp)
