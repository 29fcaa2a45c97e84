"""Checkpoints: `<artifact_dir>/checkpoints/step-<NNNNNNNN>/`, one explicit set of named parts.

A checkpoint counts only when complete: every part is written into a temporary directory and
fsynced, the manifest (SHA-256 and size of every other file) is written last, and the directory
is renamed into place. Loading verifies the manifest first; nothing is unpickled beyond plain
tensors and values (`weights_only=True`, safetensors).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from worker.error import CheckpointError
from worker.model import EOS_TOKEN, PAD_TOKEN, WEIGHTS_FILE
from worker.optim import Optimizers

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
# Parts. The model (config.json, WEIGHTS_FILE) and the tokenizer files are written by
# transformers' `save_pretrained`, so a step directory loads with plain transformers.
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = WEIGHTS_FILE
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"
MANIFEST = "manifest.json"

_STEP_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckpointState:
    step: int  # global step: updates done over the whole run
    phase_index: int
    phase_name: str
    phase_step: int
    tokens_seen: int  # tokens processed over the whole run (the microbatch envelope)
    signature: str
    attempt_id: str
    groups: dict[str, list[str]]  # optimizer -> parameter names, in group order


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint's small parts; the weights are loaded into a live model with
    `worker.model.load_weights(model, path)`."""

    path: Path
    state: CheckpointState
    optimizer: dict[str, Any]
    rng: dict[str, Any]


def step_dir_name(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def checkpoints_dir(artifact_dir: str | Path) -> Path:
    return Path(artifact_dir) / CHECKPOINTS_DIR


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_STEP_PREFIX):
        return None
    digits = name.removeprefix(_STEP_PREFIX)
    return int(digits) if digits.isdigit() else None


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory, newest first; complete or not."""
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := _step_of(p)) is not None]
    return sorted(found, reverse=True)


# --- RNG ------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Every random stream the process may draw from, as tensors and plain values."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))


# --- save -----------------------------------------------------------------------------------


def save_checkpoint(
    *,
    directory: Path,
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    optimizers: Optimizers,
    state: CheckpointState,
) -> Path:
    """Write a complete checkpoint of `state.step` under `directory` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / step_dir_name(state.step)
    tmp = directory / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()

    model.save_pretrained(tmp, safe_serialization=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    ).save_pretrained(tmp)
    torch.save(optimizers.state_dict(), tmp / OPTIMIZER)
    torch.save(capture_rng(), tmp / RNG)
    (tmp / STATE).write_text(json.dumps(asdict(state), indent=1))

    parts = sorted(p for p in tmp.rglob("*") if p.is_file())
    for part in parts:
        _fsync_file(part)
    manifest = {
        "step": state.step,
        "files": {
            p.relative_to(tmp).as_posix(): {"sha256": _sha256(p), "size": p.stat().st_size}
            for p in parts
        },
    }
    # The manifest is written last: a directory with a verifying manifest is complete.
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)

    if final.exists():
        # An earlier attempt wrote this step but died before registering it; a resumed run
        # recomputes the same step, so the newer copy replaces it.
        stale = directory / f"{_TMP_PREFIX}stale-{final.name}-{os.getpid()}"
        os.replace(final, stale)
        shutil.rmtree(stale)
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- verify and load ------------------------------------------------------------------------


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is present and intact."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST}")
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {err}") from err
    for name in (MODEL_CONFIG, MODEL_WEIGHTS, OPTIMIZER, RNG, STATE):
        if name not in files:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {name}")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has {size} bytes, the manifest says {expected['size']}"
            )
        digest = _sha256(file)
        if digest != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} has SHA-256 {digest}, "
                f"the manifest says {expected['sha256']}"
            )


def find_latest_complete(directory: Path) -> Path | None:
    """The newest checkpoint whose manifest verifies; a corrupt newer one is skipped."""
    for _, path in list_checkpoints(directory):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
            continue
        return path
    return None


def read_state(path: Path) -> CheckpointState:
    return CheckpointState(**json.loads((path / STATE).read_text()))


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Verify, then read the state, optimizer and RNG parts of the checkpoint at `path`."""
    path = Path(path)
    verify_checkpoint(path)
    return LoadedCheckpoint(
        path=path,
        state=read_state(path),
        optimizer=torch.load(path / OPTIMIZER, weights_only=True, map_location="cpu"),
        rng=torch.load(path / RNG, weights_only=True, map_location="cpu"),
    )


# --- retention ------------------------------------------------------------------------------


def apply_retention(
    directory: Path, *, keep_last: int, keep_steps: Iterable[int] = ()
) -> list[Path]:
    """Delete every checkpoint except the `keep_last` newest and those at `keep_steps` (each
    phase's final one, which the next phase starts from). Returns what was deleted."""
    kept = set(keep_steps)
    deleted = []
    for rank, (step, path) in enumerate(list_checkpoints(directory)):
        if rank < keep_last or step in kept:
            continue
        shutil.rmtree(path)
        deleted.append(path)
    return deleted


def remove_stale_temporaries(directory: Path) -> None:
    """Remove temporary directories left by writers that died mid-checkpoint (SIGKILL)."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.startswith(_TMP_PREFIX) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
