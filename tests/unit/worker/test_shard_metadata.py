"""A sharded checkpoint's DCP `.metadata` is a pickle: it is read only when the step
directory's manifest vouches for its bytes, and then with DCP's metadata classes alone."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from worker.checkpoint import manifest
from worker.checkpoint.manifest import MANIFEST
from worker.checkpoint.shards import SHARDS, SHARDS_METADATA, read_metadata, read_shards
from worker.error import CheckpointError


class Boom:
    """A pickle that calls a function when unpickled: what a tampered `.metadata` would be."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (pytest.fail, ("unpickled!",))


def sharded_step(tmp_path: Path, model: nn.Module) -> Path:
    """A step directory holding `model`'s state as DCP shards, listed in its manifest."""
    step = tmp_path / "step-00000004"
    tensors = {f"model/{name}": t for name, t in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, checkpoint_id=step / SHARDS, no_dist=True)
    write_manifest(step)
    return step


def write_manifest(step: Path) -> None:
    names = [f"{SHARDS}/{p.name}" for p in (step / SHARDS).iterdir()]
    (step / MANIFEST).write_text(json.dumps({"files": manifest.describe(step, names)}))


def test_shards_read_back_through_the_checked_metadata(tmp_path: Path) -> None:
    saved = nn.Linear(3, 2)
    step = sharded_step(tmp_path, saved)
    loaded = nn.Linear(3, 2)
    read_shards(step, model=loaded, optimizer=None, group=None, weights=True)
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias)


def test_a_tampered_metadata_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    step = sharded_step(tmp_path, nn.Linear(3, 2))
    (step / SHARDS_METADATA).write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match=r"the manifest says .* not unpickled"):
        read_metadata(step)
    with pytest.raises(CheckpointError, match="not unpickled"):
        read_shards(step, model=nn.Linear(3, 2), optimizer=None, group=None, weights=True)


def test_a_forged_metadata_can_call_nothing_even_with_a_matching_manifest(
    tmp_path: Path,
) -> None:
    step = sharded_step(tmp_path, nn.Linear(3, 2))
    (step / SHARDS_METADATA).write_bytes(pickle.dumps(Boom()))
    write_manifest(step)  # the manifest rewritten to vouch for it
    with pytest.raises(CheckpointError, match="is not part of a checkpoint's metadata"):
        read_metadata(step)


def test_metadata_the_manifest_does_not_list_is_not_read(tmp_path: Path) -> None:
    step = sharded_step(tmp_path, nn.Linear(3, 2))
    (step / MANIFEST).write_text(json.dumps({"files": {}}))
    with pytest.raises(CheckpointError, match=r"gives no digest of shards/\.metadata"):
        read_metadata(step)
