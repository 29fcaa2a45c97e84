"""Small stand-in weights for tests whose service only checks and hashes checkpoints: real
safetensors (service.checkpoints.weights reads their header) whose token embedding fits the
model of conftest.tiny_workflow (vocab_size 256; the rest left to defaults, so any hidden size)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save

TINY_VOCAB = 256


def weights_bytes(note: str = "", *, vocab: int = TINY_VOCAB, hidden: int = 4) -> bytes:
    """A safetensors file of one embedding [vocab, hidden]; `note` (kept in its metadata)
    makes files of different content."""
    tensors = {"model.embed_tokens.weight": np.zeros((vocab, hidden), np.float32)}
    return save(tensors, metadata={"note": note})


def write_weights_file(path: Path, note: str = "", **sizes: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(weights_bytes(note, **sizes))
    return path


def write_model_dir(path: Path, note: str = "", **sizes: int) -> Path:
    """A save_pretrained-shaped directory: config.json and model.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    write_weights_file(path / "model.safetensors", note, **sizes)
    return path


def altered_copy(checkpoint: Path, to: Path) -> Path:
    """A copy of a save_pretrained directory whose weights differ in their last byte (a value,
    not the header): still a checkpoint of the same model, of other content."""
    shutil.copytree(checkpoint, to)
    weights = bytearray((to / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (to / "model.safetensors").write_bytes(bytes(weights))
    return to
