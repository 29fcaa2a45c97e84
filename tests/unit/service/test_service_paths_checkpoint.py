"""What an initial checkpoint is, checked by the service without torch
(service.checkpoints.weights): safetensors read from its header alone, save_pretrained
directories, and tensors that must agree with the sizes the workflow's model config states."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from contracts.workflow import Workflow
from service.checkpoints.weights import (
    MAX_HEADER_BYTES,
    NotACheckpoint,
    checkpoint_problem,
    checkpoint_shapes,
    safetensors_shapes,
)

CONFIG = {"vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 2}


def tensors(vocab: int = 32, hidden: int = 8, layers: int = 2) -> dict[str, np.ndarray]:
    out = {
        "model.embed_tokens.weight": np.zeros((vocab, hidden), np.float32),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": np.zeros((vocab, hidden), np.float32),
    }
    for i in range(layers):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = np.zeros((hidden, hidden), np.float32)
    return out


def spec(config: dict[str, Any] | None = None) -> Workflow:
    return Workflow.model_validate(
        {
            "name": "w",
            "model": {"config": config or CONFIG},
            "tokenizer": "/t/tokenizer.json",
            "microbatch_tokens": 64,
            "phases": [
                {
                    "name": "p",
                    "objective": "continued_pretrain",
                    "data": [{"path": "/d/a.jsonl"}],
                    "sequence_length": 32,
                    "microbatch_size": 2,
                    "steps": 1,
                }
            ],
        }
    )


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def pretrained(directory: Path, **kw: Any) -> Path:
    write(directory / "config.json", json.dumps({"model_type": "llama", **CONFIG}).encode())
    write(directory / "model.safetensors", save(tensors(**kw)))
    return directory


def test_a_safetensors_file_is_read_from_its_header(tmp_path: Path) -> None:
    path = write(tmp_path / "w.safetensors", save(tensors()))
    shapes = safetensors_shapes(path)
    assert shapes["model.embed_tokens.weight"] == (32, 8)
    assert shapes["model.norm.weight"] == (8,)
    assert checkpoint_problem(str(path), spec()) is None


def test_a_save_pretrained_directory_and_a_sharded_one_fit(tmp_path: Path) -> None:
    assert checkpoint_problem(str(pretrained(tmp_path / "one")), spec()) is None
    sharded = tmp_path / "sharded"
    every = tensors()
    names = sorted(every)
    halves = {"a.safetensors": names[:2], "b.safetensors": names[2:]}
    for shard, held in halves.items():
        write(sharded / shard, save({n: every[n] for n in held}))
    index = {"weight_map": {n: s for s, held in halves.items() for n in held}}
    write(sharded / "model.safetensors.index.json", json.dumps(index).encode())
    write(sharded / "config.json", b"{}")
    assert checkpoint_shapes(sharded) == {n: tuple(t.shape) for n, t in every.items()}
    assert checkpoint_problem(str(sharded), spec()) is None


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"my-hostname\n", "is not a safetensors file"),
        (pickle.dumps({"w": [1.0, 2.0]}), "is a pickle"),
        (b"PK\x03\x04" + b"\0" * 60, "zip archive"),
        (b"", "it has 0 bytes"),
        (struct.pack("<Q", 10) + b"not json!!", "header is not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 2) + b"{}", "holds no tensors"),
    ],
)
def test_what_is_not_safetensors_is_named(tmp_path: Path, content: bytes, said: str) -> None:
    path = write(tmp_path / "weights.bin", content)
    why = checkpoint_problem(str(path), spec())
    assert why is not None and said in why, why
    assert str(path) in why


def test_a_truncated_or_corrupt_header_is_named(tmp_path: Path) -> None:
    good = save(tensors())
    truncated = write(tmp_path / "truncated.safetensors", good[:-8])
    assert "truncated or corrupt" in (checkpoint_problem(str(truncated), spec()) or "")
    (length,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + length])
    header["model.norm.weight"]["shape"] = [9]  # 9 floats in 8 floats' bytes
    body = json.dumps(header).encode()
    lying = write(
        tmp_path / "lying.safetensors", struct.pack("<Q", len(body)) + body + good[8 + length :]
    )
    assert "needs 36 bytes, its data_offsets span 32" in (
        checkpoint_problem(str(lying), spec()) or ""
    )
    header = json.loads(good[8 : 8 + length])
    header["model.norm.weight"]["dtype"] = "PICKLE"
    body = json.dumps(header).encode()
    odd = write(
        tmp_path / "odd.safetensors", struct.pack("<Q", len(body)) + body + good[8 + length :]
    )
    assert "unknown dtype 'PICKLE'" in (checkpoint_problem(str(odd), spec()) or "")


def test_a_header_longer_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(MAX_HEADER_BYTES + 16)  # sparse: the header is never read
    with pytest.raises(NotACheckpoint, match="exceeds"):
        safetensors_shapes(path)


def test_a_directory_must_be_save_pretrained_output(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    write(bare / "model.safetensors", save(tensors()))
    assert "has no config.json" in (checkpoint_problem(str(bare), spec()) or "")
    pickled = tmp_path / "pickled"
    write(pickled / "config.json", b"{}")
    write(pickled / "pytorch_model.bin", pickle.dumps({}))
    why = checkpoint_problem(str(pickled), spec()) or ""
    assert "holds no safetensors weights" in why and "pytorch_model.bin" in why, why
    index_out = tmp_path / "index-out"
    write(index_out / "config.json", b"{}")
    escape = {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}
    write(index_out / "model.safetensors.index.json", json.dumps(escape).encode())
    assert "is not a file name in the checkpoint directory" in (
        checkpoint_problem(str(index_out), spec()) or ""
    )


def test_a_sharded_phases_checkpoint_inside_the_phase_points_to_the_final_one(
    tmp_path: Path,
) -> None:
    """Inside a sharded phase a checkpoint holds the model in shards only
    (worker.checkpoint.shards): never a starting point, and the error says which one is."""
    inside = tmp_path / "step-00000004"
    write(inside / "config.json", b"{}")
    write(inside / "shards" / ".metadata", b"dcp")
    why = checkpoint_problem(str(inside), spec()) or ""
    assert "holds no safetensors weights" in why, why
    assert "shards/" in why and "phase's final checkpoint" in why, why


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {**CONFIG, "vocab_size": 64},
            "model.embed_tokens.weight is [32, 8], the model's is [64, 8]",
        ),
        ({**CONFIG, "hidden_size": 16}, "the model's is [32, 16]"),
        (
            {**CONFIG, "num_hidden_layers": 4},
            "it holds layers 0-1 (2), the model has num_hidden_layers 4",
        ),
        ({"vocab_size": 50}, "lm_head.weight is [32, 8]"),
    ],
)
def test_tensors_that_do_not_fit_the_model_are_named(
    tmp_path: Path, config: dict[str, Any], said: str
) -> None:
    path = write(tmp_path / "w.safetensors", save(tensors()))
    why = checkpoint_problem(str(path), spec(config)) or ""
    assert f"{path} does not fit the workflow's model" in why and said in why, why


def test_what_the_config_leaves_to_defaults_is_not_checked(tmp_path: Path) -> None:
    """{"vocab_size": 32} alone: any hidden size and number of layers pass here (the worker
    checks every tensor when it loads them)."""
    path = write(tmp_path / "w.safetensors", save(tensors(hidden=4, layers=3)))
    assert checkpoint_problem(str(path), spec({"vocab_size": 32})) is None
    no_embedding = write(tmp_path / "e.safetensors", save({"x": np.zeros(2, np.float32)}))
    assert "has no token embedding" in (checkpoint_problem(str(no_embedding), spec()) or "")


def test_a_pretrained_models_config_states_the_sizes(tmp_path: Path) -> None:
    base = pretrained(tmp_path / "base")
    doc = spec().model_dump()
    doc["model"] = {"pretrained": str(base)}
    with_base = Workflow.model_validate(doc)
    assert checkpoint_problem(str(base / "model.safetensors"), with_base) is None
    small = write(tmp_path / "small.safetensors", save(tensors(vocab=16)))
    assert "[16, 8], the model's is [32, 8]" in (checkpoint_problem(str(small), with_base) or "")


def test_a_missing_path_is_left_to_the_digests(tmp_path: Path) -> None:
    assert checkpoint_problem(str(tmp_path / "nope.safetensors"), spec()) is None
