"""Checkpoints on an object store, committed by manifest (worker.remote.checkpoints), on a
folder store and on the loopback S3 server: a save is invisible until its manifest, the first
manifest of a step wins, a download is the checkpoint byte for byte, leftovers are collected
and retention deletes every object of a step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tokenizers import Tokenizer

from contracts.signature import sha256_path
from contracts.workflow import OptimizerSpec, Workflow
from runtime.store import ArtifactStore, LocalStore, open_store
from worker.checkpoint.layout import MANIFEST, STATE, CheckpointState, verify_checkpoint
from worker.checkpoint.writer import CpuBuffers, snapshot, write_temporary
from worker.error import CheckpointError
from worker.model.model import build_model
from worker.model.optim import build_optimizers
from worker.model.rng import PrivateRandom
from worker.remote.checkpoints import RemoteCheckpoints, save_id

if TYPE_CHECKING:
    from conftest import S3

Save = Callable[..., Path]


@pytest.fixture(params=["folder", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> RemoteCheckpoints:
    store: ArtifactStore
    if request.param == "folder":
        store = LocalStore(tmp_path / "bucket")
        return RemoteCheckpoints("s3://bucket/root/runs/run_1", store=store)
    s3: S3 = request.getfixturevalue("s3")
    return RemoteCheckpoints(f"{s3.root}/runs/run_1", store=open_store(s3.root))


@pytest.fixture
def save(
    make_workflow: Callable[..., Workflow],
    make_text_file: Callable[..., Path],
    tokenizer: Tokenizer,
    tmp_path: Path,
) -> Save:
    """`save(step, signature=...)`: a complete temporary checkpoint of a tiny model, as the
    writer thread leaves it before any upload."""
    workflow = make_workflow(
        [{"name": "pt", "objective": "continued_pretrain", "data": [make_text_file()], "steps": 9}]
    )
    model = build_model(workflow, torch.device("cpu"))
    optimizers = build_optimizers(model, OptimizerSpec())

    def make(step: int, *, signature: str = "sig", attempt: str = "attempt-1") -> Path:
        state = CheckpointState(
            step=step,
            phase_index=0,
            phase_name="pt",
            phase_step=step,
            tokens_seen=64 * step,
            signature=signature,
            attempt_id=attempt,
            groups=optimizers.group_names(),
        )
        copy = snapshot(
            model=model,
            optimizers=optimizers,
            state=state,
            rng=PrivateRandom(0, torch.device("cpu")).state_dict(),
            buffers=CpuBuffers(),
        )
        staging = tmp_path / "staging"
        return write_temporary(directory=staging, snapshot=copy, tokenizer=tokenizer)

    return make


def test_a_save_exists_only_once_its_manifest_is_committed(
    remote: RemoteCheckpoints, save: Save, tmp_path: Path
) -> None:
    tmp = save(4)
    remote.upload_files(tmp)
    assert remote.steps() == [], "uploaded files without a manifest are no checkpoint"
    with pytest.raises(FileNotFoundError):
        remote.fetch(4, tmp_path / "elsewhere")
    assert remote.commit(tmp)
    assert remote.steps() == [4]
    assert remote.manifest(4)["save"] == save_id(tmp)
    # The local staging copy's manifest is now the remote one, byte for byte.
    assert (tmp / MANIFEST).read_bytes() == remote.store.get_bytes(
        f"{remote.prefix}/step-00000004/{MANIFEST}"
    )


def test_a_download_is_the_checkpoint_byte_for_byte(
    remote: RemoteCheckpoints, save: Save, tmp_path: Path
) -> None:
    tmp = save(8)
    remote.upload_files(tmp)
    remote.commit(tmp)
    local = remote.fetch(8, tmp_path / "host-b" / "checkpoints")
    verify_checkpoint(local)
    assert local.name == "step-00000008"
    assert sha256_path(local) == sha256_path(tmp)
    # Fetched again with the same manifest there: nothing is downloaded.
    marker = local / STATE
    before = marker.stat().st_mtime_ns
    assert remote.fetch(8, tmp_path / "host-b" / "checkpoints") == local
    assert marker.stat().st_mtime_ns == before


def test_the_first_manifest_of_a_step_wins_and_the_loser_is_removed(
    remote: RemoteCheckpoints, save: Save
) -> None:
    """A revived zombie and the attempt that replaced it save the same step: each into its own
    save folder, and the second commit keeps the first's checkpoint."""
    first, second = save(4, attempt="attempt-1"), save(4, attempt="attempt-2")
    remote.upload_files(first)
    remote.upload_files(second)
    assert remote.commit(first)
    assert not remote.commit(second)
    assert remote.manifest(4)["save"] == save_id(first)
    keys = [i.key for i in remote.store.list(f"{remote.prefix}/step-00000004")]
    assert not [k for k in keys if f"/{save_id(second)}/" in k], keys


def test_a_manifest_of_another_signature_is_set_aside_not_overwritten(
    remote: RemoteCheckpoints, save: Save
) -> None:
    foreign, ours = save(4, signature="other"), save(4)
    for tmp in (foreign, ours):
        remote.upload_files(tmp)
    assert remote.commit(foreign)
    assert remote.commit(ours)
    assert remote.manifest(4)["save"] == save_id(ours)
    aside = [i.key for i in remote.store.list(remote.prefix) if ".corrupt-" in i.key]
    assert len(aside) == 1 and aside[0].endswith(MANIFEST), aside


def test_leftovers_of_uncommitted_saves_are_collected(
    remote: RemoteCheckpoints, save: Save
) -> None:
    committed, crashed = save(4), save(8)
    remote.upload_files(committed)
    remote.commit(committed)
    remote.upload_files(crashed)  # killed before its manifest
    loser = save(4, attempt="attempt-2")
    remote.upload_files(loser)  # a save of a committed step that never committed
    deleted = remote.collect_leftovers()
    assert deleted and all(
        f"/{save_id(crashed)}/" in k or f"/{save_id(loser)}/" in k for k in deleted
    )
    remaining = [i.key for i in remote.store.list(remote.prefix)]
    assert remaining and all(
        k.endswith(MANIFEST) or f"/{save_id(committed)}/" in k for k in remaining
    )
    assert remote.steps() == [4]


def test_deleting_a_step_removes_every_object_manifest_first(
    remote: RemoteCheckpoints, save: Save
) -> None:
    for step in (4, 8):
        tmp = save(step)
        remote.upload_files(tmp)
        remote.commit(tmp)
    remote.delete(4)
    assert remote.steps() == [8]
    assert list(remote.store.list(f"{remote.prefix}/step-00000004")) == []


def test_a_corrupt_download_is_put_in_place_for_the_loader_to_quarantine(
    remote: RemoteCheckpoints, save: Save, tmp_path: Path
) -> None:
    tmp = save(4)
    remote.upload_files(tmp)
    remote.commit(tmp)
    key = f"{remote.prefix}/step-00000004/{save_id(tmp)}/{STATE}"
    remote.store.put_bytes(key, json.dumps({"tampered": True}).encode())
    local = remote.fetch(4, tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=STATE):
        verify_checkpoint(local)


def test_a_folder_that_is_no_run_is_refused() -> None:
    with pytest.raises(CheckpointError, match="not a run's folder"):
        RemoteCheckpoints("s3://bucket/root/elsewhere")
