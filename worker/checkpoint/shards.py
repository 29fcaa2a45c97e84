"""Sharded checkpoints: each rank writes its own shards with torch.distributed.checkpoint.

A sharded phase (FSDP2, `"sharding": "fsdp"`) holds every parameter and its optimizer state as
DTensors whose shards live on different ranks. Gathering them whole at each checkpoint would
need the whole model in one host's memory and a collective per tensor while training waits.
Instead, at a checkpoint step every rank stages its own shards into CPU memory (the loop waits
for that copy only) and DCP (`torch.distributed.checkpoint.async_save`) writes them from a
background thread into `<step directory>/shards/`: one file per rank and DCP's `.metadata`,
coordinated over a gloo group of the checkpoint's own, so that its collectives never interleave
with training's. Rank 0 writes the rest of the step directory as one device does (config,
tokenizer, the optimizers' hyperparameters and unsharded state in `optimizer.pt`, every rank's
RNG, `state.json`), waits for the shards, and only then writes the manifest: a step directory
is complete only when every rank's part is (worker.checkpoint.writer). Each rank hashes the shard
files it wrote, once its save is on disk, and rank 0 gathers their digests for the manifest:
it never reads another rank's shards, which at hundreds of GB would outlast the collective
timeout of the ranks waiting for it. On resume, each rank verifies the shard files it reads
(`verifier_of`).

The phase's final checkpoint also holds the model gathered whole, tensor by tensor into rank
0's CPU memory, as `model.safetensors`: it loads with plain transformers, and the next phase
starts from it.

Reading reshards: DCP reads, for each rank, the parts of the saved shards that its own tensors
cover, whatever the number of ranks that wrote them; one process without a process group reads
every tensor whole. The tensors go through DCP as `torch.load(weights_only=True)`. DCP's
`.metadata` (which tensors, their sizes and where each shard lies) is a pickle, which DCP reads
with plain `pickle.load`; it is never read so here (`_CheckedReader`): its bytes are read once
into memory, their SHA-256 must be the one the step directory's manifest lists (which the
checkpoint's verification checked against every other file), and they are unpickled by an
unpickler that can build DCP's metadata classes, tensor sizes, dtypes, layouts and paths, and
nothing else: a tampered `.metadata` is refused before a byte of it is unpickled, and a forged
one (manifest rewritten to match) can name no function to call.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from worker.checkpoint import manifest
from worker.error import CheckpointError
from worker.model.optim import Optimizers

SHARDS = "shards"
SHARDS_METADATA = f"{SHARDS}/.metadata"
_MODEL = "model/"
_OPTIMIZER = "optimizer/"
# DCP's FileSystemWriter names rank k's files `__<k>_<i>.distcp`; rank 0 writes `.metadata`.
_RANK_FILE = re.compile(rf"{SHARDS}/__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class ShardedSave:
    """One rank's part of a sharded checkpoint in flight, as rank 0's checkpoint writer needs
    it (worker.checkpoint.writer)."""

    directory: Path  # the temporary step directory every rank writes its shards into
    # Done once every rank's shards are on disk, each rank's hashed by that rank: on rank 0 the
    # manifest entries of every shard file (worker.checkpoint.manifest), on the others their own.
    written: Future[dict[str, manifest.Entry]]
    optimizer: dict[str, Any]  # Optimizers.state_dict() less its DTensors (in the shards)
    weights: dict[str, torch.Tensor] | None  # the model gathered whole (the phase's last step)


def has_shards(path: Path) -> bool:
    return (path / SHARDS_METADATA).is_file()


def writer_of(name: str) -> int:
    """The rank that wrote the checkpoint file `name` (relative to its step directory): rank k
    its shard files, rank 0 everything else."""
    found = _RANK_FILE.fullmatch(name)
    return int(found.group(1)) if found else 0


def verifier_of(name: str, world: int) -> int:
    """Which of `world` ranks verifies the checkpoint file `name` on resume: on the count that
    wrote it, the rank that wrote it, which reads it next (DCP reads a rank's own shards back
    to it); on another count, one of them each, in turn."""
    return writer_of(name) % world


def split_state(
    model: nn.Module, optimizers: Optimizers
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(what DCP writes: the model's state and every DTensor of the optimizers' state, by flat
    key; the optimizers' state without those DTensors, for `optimizer.pt`)."""
    tensors = {f"{_MODEL}{name}": t for name, t in model.state_dict().items()}
    rest: dict[str, Any] = {}
    for key, part in optimizers.state_dict().items():
        state: dict[str, dict[str, Any]] = {}
        for name, values in part["state"].items():
            state[name] = {}
            for field, value in values.items():
                if isinstance(value, DTensor):
                    tensors[_optimizer_key(key, name, field)] = value
                else:
                    state[name][field] = value
        rest[key] = {**part, "state": state}
    return tensors, rest


def _optimizer_key(optimizer: str, name: str, field: str) -> str:
    return f"{_OPTIMIZER}{optimizer}/{name}/{field}"


class ShardWriter:
    """A rank's side of sharded checkpoints. `start` is a collective: every rank calls it at
    the same step. Creating one is a collective too (its process group)."""

    def __init__(self, *, rank: int, device: torch.device) -> None:
        self._rank = rank
        # DCP's own collectives run in its writer thread: never on training's group.
        self._group = dist.new_group(backend="gloo")
        cuda = device.type == "cuda"
        # Staging buffers are kept from one save to the next (pinned on CUDA, so the copies
        # off the device are DMA); a save starts only once the previous one is on disk.
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
        # Hashes this rank's shards once they are written, then hands the digests to rank 0.
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-digests")
        self._pending: Future[dict[str, manifest.Entry]] | None = None
        self._last: tuple[int, ShardedSave] | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group

    def start(
        self,
        step: int,
        *,
        temporary: Path,
        model: nn.Module,
        optimizers: Optimizers,
        whole: bool,
    ) -> ShardedSave:
        """Stage this rank's shards of `step` and write them in the background into rank 0's
        `temporary` step directory (the same save again when `step` is already under way).
        `whole`: gather the model whole too, on rank 0."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        self.wait()
        chosen = [str(temporary)]
        dist.broadcast_object_list(chosen, src=0, group=self._group)
        temporary = Path(chosen[0])
        tensors, rest = split_state(model, optimizers)
        written = dcp.async_save(
            tensors,
            checkpoint_id=temporary / SHARDS,
            process_group=self._group,
            async_stager=self._stager,
        )
        if not isinstance(written, Future):  # an AsyncSaveResponse: staging in the background
            raise CheckpointError(f"unexpected answer of DCP's async_save: {type(written)}")
        described = self._hasher.submit(self._describe, written, temporary)
        self._pending = described
        weights = None
        if whole:
            # One tensor at a time: gathered, moved to rank 0's CPU memory, freed on device.
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            gathered = get_model_state_dict(model, options=options)
            weights = cast(dict[str, torch.Tensor], gathered) if self._rank == 0 else None
        saved = ShardedSave(temporary, described, rest, weights)
        self._last = (step, saved)
        return saved

    def _describe(self, written: Future[Any], directory: Path) -> dict[str, manifest.Entry]:
        """In this rank's hashing thread: once its DCP save is on disk (`written`), the manifest
        entries of the shard files it wrote, gathered on rank 0 with every other rank's. A
        collective over the checkpoint's group, after DCP's own on it; every rank makes it,
        whatever its save did, so that no one waits for a rank that failed."""
        mine: dict[str, manifest.Entry] | str
        failed: BaseException | None = None
        try:
            written.result()
            names = sorted(f"{SHARDS}/{p.name}" for p in (directory / SHARDS).iterdir())
            own = [name for name in names if writer_of(name) == self._rank]
            mine = manifest.describe(directory, own)
        except Exception as err:
            failed, mine = err, f"rank {self._rank}: {type(err).__name__}: {err}"
        gathered: list[Any] | None = None
        if self._rank == 0:
            gathered = [None] * dist.get_world_size(self._group)
        dist.gather_object(mine, gathered, dst=0, group=self._group)
        if failed is not None:
            raise failed
        if gathered is None:
            return cast(dict[str, manifest.Entry], mine)
        if problems := [part for part in gathered if isinstance(part, str)]:
            raise CheckpointError(f"checkpoint {directory}: {'; '.join(problems)}")
        return {name: entry for part in gathered for name, entry in part.items()}

    def wait(self) -> None:
        """Block until this rank's save in flight is on disk and hashed (raising what it
        raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Let a save in flight finish (its directory is published, or not, by rank 0), then
        free the staging buffers."""
        try:
            self.wait()
        finally:
            self._hasher.shutdown(wait=True)
            self._stager.close()


# What DCP's `.metadata` pickle names (torch 2.x's FileSystemWriter): its metadata classes,
# torch.Size, dtypes (below), layouts by name, and the checkpoint's path. Nothing that runs code.
_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "TensorProperties",
                "ChunkStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and refuses any other global (a pickle's way to run code)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(step: Path) -> Metadata:
    """The DCP metadata of the sharded checkpoint in the step directory `step`: read once,
    checked against the manifest's SHA-256 and size of it, then unpickled with DCP's metadata
    classes only. CheckpointError, naming the file, otherwise."""
    expected = manifest.entry_of(step, SHARDS_METADATA)
    data = (step / SHARDS_METADATA).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if (digest, len(data)) != (expected["sha256"], expected["size"]):
        raise CheckpointError(
            f"checkpoint {step}: {SHARDS_METADATA} has SHA-256 {digest} ({len(data)} bytes), "
            f"the manifest says {expected['sha256']} ({expected['size']} bytes); not unpickled"
        )
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {step}: {SHARDS_METADATA} refused: {err}") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {step}: {SHARDS_METADATA} holds no DCP metadata")
    return metadata


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by `read_metadata` instead of `pickle.load`.
    No `**kwargs` in `read_metadata`: DCP then never falls back to per-rank metadata files."""

    def __init__(self, step: Path) -> None:
        super().__init__(str(step / SHARDS))
        self._step = step

    def read_metadata(self, *args: Any) -> Metadata:
        metadata = read_metadata(self._step)
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id  # as DCP's own reader does
        metadata.storage_meta = storage
        return metadata


def read_shards(
    path: Path,
    *,
    model: nn.Module,
    optimizer: dict[str, Any] | None,
    group: dist.ProcessGroup | None,
    weights: bool,
) -> dict[str, Any] | None:
    """Read the sharded checkpoint at `path` into the live `model` (`weights`: its parameters
    and buffers, in place) and, given `optimizer` (its `optimizer.pt`: the state without its
    shards), that state completed with its saved tensors, shaped as the live parameters are
    (DTensors sharded like them, or whole). A collective over `group` when one is given (every
    rank reads at once), else one process reading everything."""
    reader = _CheckedReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    live = model.state_dict()
    targets: dict[str, torch.Tensor] = {}
    if weights:
        stored = {k.removeprefix(_MODEL) for k in metadata if k.startswith(_MODEL)}
        if stored != set(live):
            missing, unexpected = sorted(set(live) - stored), sorted(stored - set(live))
            raise CheckpointError(
                f"checkpoint {path}: its shards do not fit the model: missing {missing[:5]} "
                f"({len(missing)} in all), unexpected {unexpected[:5]} "
                f"({len(unexpected)} in all)"
            )
        targets.update({f"{_MODEL}{name}": tensor for name, tensor in live.items()})
    completed = None
    if optimizer is not None:
        params = dict(model.named_parameters())
        completed = {
            key: {**part, "state": {n: dict(s) for n, s in part["state"].items()}}
            for key, part in optimizer.items()
        }
        for fqn, entry in metadata.items():
            if not fqn.startswith(_OPTIMIZER) or not isinstance(entry, TensorStorageMetadata):
                continue
            key, rest = fqn.removeprefix(_OPTIMIZER).split("/", 1)
            name, field = rest.rsplit("/", 1)
            param = params.get(name)
            dtype = entry.properties.dtype
            if param is not None and tuple(param.shape) == tuple(entry.size):
                target = torch.zeros_like(param, dtype=dtype, requires_grad=False)
            else:
                target = torch.zeros(tuple(entry.size), dtype=dtype)
            targets[fqn] = target
            completed[key]["state"].setdefault(name, {})[field] = target
    with torch.no_grad(), warnings.catch_warnings():
        # Said of every read without a process group, which is meant here.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            targets,
            storage_reader=reader,
            process_group=group,
            no_dist=group is None,
        )
    return completed
