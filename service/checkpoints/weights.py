"""What an initial checkpoint is.

The service cannot build the model (it imports no torch), so it checks what can be read
without it: that the weights are safetensors (an 8-byte little-endian header length, a JSON
header of bounded size, tensors that tile the data exactly), that a directory is
`save_pretrained` output, and that the tensors agree with what the workflow's model config
states: the token embedding is [vocab_size, hidden_size], the output head [vocab_size, ...],
and the layers number num_hidden_layers. The worker checks every name and shape strictly when
it loads them (worker.model.model.load_weights). Nothing is ever unpickled.

What it reads goes through a small reader (`Files`: a file's size and a byte range of it, by
name): `LocalFiles` over a path, `StoreFiles` over an object store, where a checkpoint is an
object, a prefix, or a remote-layout checkpoint whose manifest names its files
(service.checkpoints.remote). Only config.json, the shard index and the safetensors headers are
read (a few range reads); the weights themselves never are.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from contracts.paths import is_uri
from contracts.workflow import Workflow as WorkflowSpec
from runtime.store import ArtifactStore, StoreError, object_at
from service.checkpoints.remote import object_entries, remote_manifest

WEIGHTS_FILE: Final = "model.safetensors"
WEIGHTS_INDEX_FILE: Final = "model.safetensors.index.json"
# Where a sharded phase's checkpoints hold their tensors (worker.checkpoint.shards).
SHARDS_DIR: Final = "shards"
CONFIG_FILE: Final = "config.json"
# A header this long describes ~100k tensors; a longer one is refused before it is read.
MAX_HEADER_BYTES: Final = 16 * 2**20
# config.json and the shard index are small JSON documents.
MAX_JSON_BYTES: Final = 16 * 2**20
# Bytes per element of each safetensors dtype (the ones a model is saved in).
DTYPE_BYTES: Final = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# Names of the token embedding in transformers' causal LMs (llama and its kin, gpt2, bloom,
# gpt-neox) and of the output head.
EMBEDDING_SUFFIXES: Final = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                             "embed_in.weight")  # fmt: skip
HEAD_SUFFIX: Final = "lm_head.weight"
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")
# Aliases of a transformers config's sizes across model types.
_VOCAB = ("vocab_size",)
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
# What pickled weights are called: named in the refusal, never loaded.
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.ckpt")

Shapes = dict[str, tuple[int, ...]]


class NotACheckpoint(ValueError):
    """What is wrong with a checkpoint, in a sentence naming the file."""


class Files(Protocol):
    """A checkpoint's files, read by name relative to it ("" is the checkpoint itself when it
    is one file)."""

    def kind(self) -> Literal["file", "directory", "missing"]: ...

    def size(self, name: str) -> int | None:
        """The file's size; None when there is no such file."""

    def read(self, name: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive) of the file; OSError when it cannot be read."""

    def has_folder(self, name: str) -> bool:
        """Whether a folder `name` (a file under `name/`) is there."""

    def label(self, name: str) -> str:
        """The file, as messages name it."""


@dataclass(frozen=True)
class LocalFiles:
    """The files of a checkpoint at a local path."""

    path: Path

    def _at(self, name: str) -> Path:
        return self.path / name if name else self.path

    def kind(self) -> Literal["file", "directory", "missing"]:
        if self.path.is_file():
            return "file"
        return "directory" if self.path.is_dir() else "missing"

    def size(self, name: str) -> int | None:
        target = self._at(name)
        return target.stat().st_size if target.is_file() else None

    def read(self, name: str, start: int, end: int) -> bytes:
        with self._at(name).open("rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def has_folder(self, name: str) -> bool:
        return self._at(name).is_dir()

    def label(self, name: str) -> str:
        return str(self._at(name))


@dataclass(frozen=True)
class StoreFiles:
    """The files of a checkpoint in an object store: name -> (URI, size); `single` when the
    checkpoint is one object (its name is "")."""

    uri: str
    store: ArtifactStore
    files: dict[str, tuple[str, int]] = field(default_factory=dict)
    single: bool = False

    @classmethod
    def at(cls, uri: str) -> StoreFiles:
        """The checkpoint `uri` names: a remote-layout checkpoint (its manifest's files, under
        `<uri>/<save>/`), else an object, else the objects under `uri/`; no files when none is
        there. StoreError when the store refuses."""
        store, _ = object_at(uri)
        base = uri.rstrip("/")
        manifest = remote_manifest(base)
        if manifest is not None:
            files = {
                name: (manifest.key_of(name), int(entry["size"]))
                for name, entry in manifest.files.items()
            }
            return cls(uri=base, store=store, files=files)
        try:
            entries = object_entries(base)
        except FileNotFoundError:
            return cls(uri=base, store=store)
        if entries[0][0] == "":
            return cls(uri=base, store=store, files={"": (base, entries[0][2])}, single=True)
        return cls(
            uri=base, store=store, files={rel: (f"{base}/{rel}", size) for rel, _, size in entries}
        )

    def kind(self) -> Literal["file", "directory", "missing"]:
        if self.single:
            return "file"
        return "directory" if self.files else "missing"

    def size(self, name: str) -> int | None:
        found = self.files.get(name)
        return None if found is None else found[1]

    def read(self, name: str, start: int, end: int) -> bytes:
        uri = self.files[name][0]
        _, key = object_at(uri)
        try:
            return self.store.get_range(key, start, end)
        except StoreError as err:
            raise OSError(str(err)) from err

    def has_folder(self, name: str) -> bool:
        return any(n.startswith(f"{name}/") for n in self.files)

    def label(self, name: str) -> str:
        return (
            self.files[name][0]
            if name in self.files
            else f"{self.uri}/{name}"
            if name
            else self.uri
        )


def checkpoint_files(location: str | Path) -> Files:
    """The reader of the checkpoint at `location`: a local path or an `s3://` URI."""
    if isinstance(location, str) and is_uri(location):
        return StoreFiles.at(location)
    return LocalFiles(Path(location))


def safetensors_shapes(path: Path) -> Shapes:
    """The tensors of a local safetensors file (file_shapes)."""
    return file_shapes(LocalFiles(path), "")


def file_shapes(files: Files, name: str) -> Shapes:
    """The tensors of safetensors file `name` of `files`, name -> shape, read from its header
    alone (two range reads); raises NotACheckpoint naming the file and what is wrong (not
    safetensors, a pickle, a header too long, truncated or corrupt)."""
    path = files.label(name)
    try:
        size = files.size(name)
        if size is None:
            raise NotACheckpoint(f"{path} does not exist")
        head = files.read(name, 0, 8)
        if len(head) < 8:
            raise NotACheckpoint(f"{path} is not a safetensors file: it has {size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise NotACheckpoint(_not_safetensors(path, head, length, size))
        header_bytes = files.read(name, 8, 8 + length)
    except OSError as err:
        raise NotACheckpoint(f"{path} cannot be read: {err}") from err
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError) as err:
        raise NotACheckpoint(f"{path}: the safetensors header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise NotACheckpoint(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    shapes: Shapes = {}
    spans: list[tuple[int, int, str]] = []
    for tensor, entry in header.items():
        shape, span = _entry(path, tensor, entry)
        shapes[tensor] = shape
        spans.append((*span, tensor))
    if not shapes:
        raise NotACheckpoint(f"{path} holds no tensors")
    data = size - 8 - length
    position = 0
    for begin, end, tensor in sorted(spans):
        if begin != position:
            raise NotACheckpoint(
                f"{path}: tensor {tensor} starts at byte {begin} of the data, expected "
                f"{position} (the header is corrupt: tensors overlap or leave gaps)"
            )
        position = end
    if position != data:
        raise NotACheckpoint(
            f"{path}: the header describes {position} bytes of tensor data, the file holds "
            f"{data} (truncated or corrupt)"
        )
    return shapes


def _not_safetensors(path: str, head: bytes, length: int, size: int) -> str:
    if head[:1] == b"\x80" or head[:2] == b"PK":
        kind = "a pickle" if head[:1] == b"\x80" else "a zip archive (torch.save's format)"
        return (
            f"{path} is {kind}, not a safetensors file; trainctl never unpickles weights: save "
            "them with safetensors (save_pretrained writes model.safetensors)"
        )
    if length > MAX_HEADER_BYTES and length <= size - 8:
        return f"{path}: its safetensors header of {length} bytes exceeds {MAX_HEADER_BYTES}"
    return (
        f"{path} is not a safetensors file: its first 8 bytes give a header of {length} bytes, "
        f"the file has {size} (not safetensors, or truncated)"
    )


def _entry(path: str, name: str, entry: Any) -> tuple[tuple[int, ...], tuple[int, int]]:
    bad = f"{path}: tensor {name[:200]!r} in the safetensors header"
    if not isinstance(entry, dict):
        raise NotACheckpoint(f"{bad} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise NotACheckpoint(f"{bad} has an unknown dtype {str(dtype)[:40]!r}")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise NotACheckpoint(f"{bad} has no shape (a list of sizes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise NotACheckpoint(f"{bad} has no data_offsets [begin, end]")
    begin, end = offsets
    elements = 1
    for dim in shape:
        elements *= dim
    if end - begin != elements * DTYPE_BYTES[dtype]:
        raise NotACheckpoint(
            f"{bad}: shape {shape} of {dtype} needs {elements * DTYPE_BYTES[dtype]} bytes, "
            f"its data_offsets span {end - begin}"
        )
    return tuple(shape), (begin, end)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_object(files: Files, name: str, what: str) -> dict[str, Any]:
    path = files.label(name)
    try:
        size = files.size(name)
        if size is None:
            raise NotACheckpoint(f"{path} does not exist")
        if size > MAX_JSON_BYTES:
            raise NotACheckpoint(f"{path}: {what} larger than {MAX_JSON_BYTES} bytes")
        value = json.loads(files.read(name, 0, size))
    except OSError as err:
        raise NotACheckpoint(f"{path} cannot be read: {err}") from err
    except (UnicodeDecodeError, ValueError) as err:
        raise NotACheckpoint(f"{path}: {what} is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise NotACheckpoint(f"{path}: {what} is not a JSON object")
    return value


def checkpoint_shapes(path: Path) -> Shapes:
    """The tensors of a local checkpoint (files_shapes)."""
    return files_shapes(LocalFiles(path))


def files_shapes(files: Files) -> Shapes:
    """The tensors of a checkpoint: a safetensors file, or a `save_pretrained` directory
    (config.json and model.safetensors, or shards listed in model.safetensors.index.json).
    Raises NotACheckpoint saying what is wrong."""
    kind = files.kind()
    path = files.label("")
    if kind == "file":
        return file_shapes(files, "")
    if kind != "directory":
        raise NotACheckpoint(f"{path} is neither a safetensors file nor a directory")
    pickles = [name for name in _PICKLES if files.size(name) is not None]
    if files.size(CONFIG_FILE) is None:
        raise NotACheckpoint(f"{path} is not a save_pretrained directory: it has no {CONFIG_FILE}")
    _json_object(files, CONFIG_FILE, CONFIG_FILE)
    if files.size(WEIGHTS_FILE) is not None:
        return file_shapes(files, WEIGHTS_FILE)
    if files.size(WEIGHTS_INDEX_FILE) is not None:
        return _sharded_shapes(files)
    found = f" (it has {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
    if files.has_folder(SHARDS_DIR):
        found = (
            f" (its weights are in {SHARDS_DIR}/: a sharded phase writes them whole only into "
            "the phase's final checkpoint; start from that one)"
        )
    raise NotACheckpoint(
        f"{path} holds no safetensors weights: neither {WEIGHTS_FILE} nor "
        f"{WEIGHTS_INDEX_FILE}{found}"
    )


def _sharded_shapes(files: Files) -> Shapes:
    index_path = files.label(WEIGHTS_INDEX_FILE)
    weight_map = _json_object(files, WEIGHTS_INDEX_FILE, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise NotACheckpoint(f"{index_path} has no weight_map of tensor -> shard file")
    shards: dict[str, set[str]] = defaultdict(set)
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise NotACheckpoint(
                f"{index_path}: tensor {name[:200]!r} names shard {str(shard)[:200]!r}, which "
                "is not a file name in the checkpoint directory"
            )
        shards[shard].add(name)
    shapes: Shapes = {}
    for shard, names in sorted(shards.items()):
        if files.size(shard) is None:
            raise NotACheckpoint(
                f"{index_path} names shard {shard}, which is not in {files.label('')}"
            )
        held = file_shapes(files, shard)
        if missing := sorted(names - set(held)):
            raise NotACheckpoint(
                f"{files.label(shard)} lacks {len(missing)} tensor(s) the index puts there: "
                f"{missing[:5]}"
            )
        shapes.update(held)
    return shapes


def model_sizes(spec: WorkflowSpec) -> dict[str, int]:
    """What the workflow's model config states of its sizes (`vocab`, `hidden`, `layers`): its
    `config`, or the config.json of its pretrained directory. A size it leaves to the model
    type's default is not stated, and not checked here."""
    config: Mapping[str, Any] = spec.model.config or {}
    if spec.model.pretrained is not None:
        try:
            files = checkpoint_files(spec.model.pretrained)
        except (StoreError, ValueError) as err:
            raise NotACheckpoint(f"{spec.model.pretrained} cannot be read: {err}") from err
        config = _json_object(files, CONFIG_FILE, CONFIG_FILE)
    sizes: dict[str, int] = {}
    for key, aliases in (("vocab", _VOCAB), ("hidden", _HIDDEN), ("layers", _LAYERS)):
        value = next((config[a] for a in aliases if a in config), None)
        if isinstance(value, int) and _count(value):
            sizes[key] = value
    return sizes


def fit_problems(shapes: Shapes, sizes: Mapping[str, int]) -> list[str]:
    """How tensors `shapes` disagree with the model sizes `sizes` (model_sizes); empty when
    they agree in everything this can tell."""
    problems = []
    vocab, hidden, layers = sizes.get("vocab"), sizes.get("hidden"), sizes.get("layers")
    embeddings = {n: s for n, s in shapes.items() if n.endswith(EMBEDDING_SUFFIXES)}
    if not embeddings:
        problems.append(
            "it has no token embedding (a tensor named *" + ", *".join(EMBEDDING_SUFFIXES) + ")"
        )
    want = [vocab, hidden]
    for name, shape in sorted(embeddings.items()):
        if len(shape) != 2 or any(
            w is not None and w != d for w, d in zip(want, shape, strict=True)
        ):
            problems.append(f"{name} is {list(shape)}, the model's is {_shown(want)}")
    for name, shape in sorted(shapes.items()):
        if name.endswith(HEAD_SUFFIX) and (len(shape) != 2 or (vocab and shape[0] != vocab)):
            problems.append(f"{name} is {list(shape)}, the model's is {_shown([vocab, hidden])}")
    if layers is not None:
        found = {int(m.group(1)) for n in shapes if (m := _LAYER.search(n))}
        if found != set(range(layers)):
            held = f"layers {min(found)}-{max(found)} ({len(found)})" if found else "no layers"
            problems.append(f"it holds {held}, the model has num_hidden_layers {layers}")
    return problems


def _shown(sizes: list[int | None]) -> str:
    return "[" + ", ".join("?" if s is None else str(s) for s in sizes) + "]"


def checkpoint_problem(path: str, spec: WorkflowSpec) -> str | None:
    """Why the checkpoint at `path` cannot be `spec`'s initial weights, in a sentence naming
    the file and what is wrong; None when it is safetensors weights that fit the model as far as
    its config tells (the worker checks every tensor when it loads them). `path` may be an
    `s3://` URI (read by ranges, StoreFiles). A path that does not exist is left to the digests
    (`missing_input`)."""
    try:
        files = checkpoint_files(path)
    except (StoreError, ValueError) as err:
        return f"{path} cannot be read: {err}"
    if files.kind() == "missing":
        return None
    try:
        shapes = files_shapes(files)
        sizes = model_sizes(spec)
    except NotACheckpoint as err:
        return str(err)
    problems = fit_problems(shapes, sizes)
    if problems:
        return f"{path} does not fit the workflow's model: " + "; ".join(problems)
    return None
