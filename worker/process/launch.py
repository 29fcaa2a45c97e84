"""A phase on many devices: N ranks of torch.distributed on one worker.

The worker process that claimed the attempt (the parent) verifies its inputs, then starts N
rank processes as torchrun does (torch.distributed.elastic's `start_processes`; RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in each one's environment) and supervises
them: one rank that dies makes elastic end the others, and the parent reports the attempt
failed, naming the rank that failed first, by time, and its error (with its cause, as on one
device: `oom`, `disk_full`, ...) or how it ended (`infrastructure`, which the service recovers
from its latest checkpoint as it does a lost worker's).
Every collective has a timeout (TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS), so a rank that hangs
fails the attempt too. A rank dies with the parent (PR_SET_PDEATHSIG): a SIGKILLed worker
leaves no rank training behind it.

Across machines (a `Gang`: `nodes` members of an attempt, one worker each), each member starts
its own `devices` ranks the same way, numbered node_rank * devices + local rank of nodes *
devices, and they meet as torchrun's c10d rendezvous makes them meet: global rank 0 (on member
0) serves a TCPStore at the rendezvous host and port, every rank connects to it, and the
process group is initialised over it. A rank that cannot reach the store, or waits in it for
members that never join, fails after TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS naming them; a rank
whose peer dies fails in its next collective (gloo sees the connection close at once; a hung
peer, at the collective timeout), naming the members whose ranks stopped beating in the store.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import torch
import torch.distributed as dist

from contracts.reports import FailureCause
from worker.error import failure_cause
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

log = logging.getLogger(__name__)


# In the launch directory: rank 0 creates REPORTING once its own reporter holds the lease (the
# parent then lets go of it); the parent creates PREEMPT when it gets a preemption notice.
REPORTING = "reporting"
PREEMPT = "preempt"
# A rank whose work raised writes `failed-<rank>.json` there: when and why (`_first_failure`).
_FAILED_NOTE = "failed-"
# Elastic's name of an error file it has none of.
_NOT_AVAILABLE = "<N/A>"

_PR_SET_PDEATHSIG = 1
# Elastic turns these into an exception in the process that starts the ranks; in a worker,
# SIGTERM is Celery's warm shutdown (the preemption notice) and must stay Celery's.
_ELASTIC_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def owned_devices(settings: WorkerSettings) -> tuple[Literal["cpu", "cuda"], list[int]]:
    """(device kind, indices of the devices this worker owns). TRAINCTL_DEVICES is a count
    ("2": on CPU, two gloo ranks) or CUDA indices ("0,1"); unset: every visible GPU, or one
    CPU rank."""
    cuda = settings.device != "cpu" and torch.cuda.is_available()
    kind: Literal["cpu", "cuda"] = "cuda" if cuda else "cpu"
    given = settings.devices.strip()
    if not given:
        return kind, list(range(torch.cuda.device_count() if cuda else 1))
    if "," in given:
        return kind, [int(part) for part in given.split(",") if part.strip()]
    return kind, list(range(int(given)))


def rank_device(kind: str, ids: list[int], local_rank: int) -> torch.device:
    return torch.device("cuda", ids[local_rank]) if kind == "cuda" else torch.device("cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    kept = {sig: signal.getsignal(sig) for sig in _ELASTIC_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class Gang:
    """This worker's part of an attempt across `nodes` workers: member `node_rank`, its ranks
    meeting the others' at the c10d rendezvous `host`:`port` (a TCPStore served by global rank
    0, on member 0)."""

    nodes: int
    node_rank: int
    host: str
    port: int


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str
    # As on one device (worker.error.failure_cause): a rank's out-of-memory is `oom`.
    cause: FailureCause = "infrastructure"


# What `run_ranks` answers when `abort` ended the ranks.
STOPPED = RankFailure(-1, "the ranks were stopped: the service said stop")


def run_ranks(
    work: Callable[..., object],
    world: int,
    args: tuple[object, ...],
    *,
    workdir: Path,
    stop_requested: Callable[[], bool],
    handed_over: Callable[[], None],
    gang: Gang | None = None,
    abort: Callable[[], bool] = lambda: False,
) -> tuple[object, RankFailure | None]:
    """Start `world` rank processes, each running `work(device, workdir, *args)` in the
    process group (`rank_main`; `work` a module-level function, which pickles), and wait for
    them: (local rank 0's return value, None) when every rank ended well, (None, the first
    failure) when one did not (the others are ended then). `handed_over` is called once rank 0
    creates REPORTING in `workdir`, or when the ranks end; when `stop_requested()` turns true,
    PREEMPT is created there. With a `gang`, these are the ranks of one member of an attempt
    across machines (the process group spans every member's ranks). When `abort()` turns true
    the ranks are ended at once and the answer is (None, STOPPED): a member that is not the
    first holds no rank 0 to pass an order to, and stops its ranks itself when told to stop."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    nodes, node_rank = (gang.nodes, gang.node_rank) if gang is not None else (1, 0)
    host, port = (gang.host, gang.port) if gang is not None else ("127.0.0.1", free_port())
    envs = {
        local: {
            "RANK": str(node_rank * world + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(nodes * world),
            "LOCAL_WORLD_SIZE": str(world),
            # torchrun's name of the node's index among the nodes.
            "GROUP_RANK": str(node_rank),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
        for local in range(world)
    }
    with _signals_kept():
        context = start_processes(
            name="trainctl-rank",
            entrypoint=rank_main,
            args={rank: (work, str(workdir), *args) for rank in range(world)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "logs")),
        )
    log.info(
        "started %d ranks of %d (member %d of %d, rendezvous %s:%d)",
        world,
        nodes * world,
        node_rank,
        nodes,
        host,
        port,
    )
    told = reporting = False
    try:
        while (result := context.wait(timeout=0.5, period=0.1)) is None:
            if not reporting and (workdir / REPORTING).exists():
                reporting = True
                handed_over()
            if not told and stop_requested():
                told = True
                (workdir / PREEMPT).touch()
            if abort():
                log.info("stopping the ranks of member %d: told to stop", node_rank)
                return None, STOPPED
    finally:
        context.close()
    if not reporting:
        handed_over()
    if result.is_failed():
        return None, _first_failure(
            result.failures, _read_notes(workdir), world, node_rank * world, nodes * world
        )
    return result.return_values.get(0), None


@dataclass(frozen=True)
class _Note:
    """What a rank whose work raised wrote down (`rank_main`), before it left the group."""

    at: int  # time.time_ns()
    message: str
    cause: FailureCause


def _note_failure(workdir: Path, rank: int, err: Exception) -> None:
    note = {
        "at": time.time_ns(),
        "message": f"{type(err).__name__}: {err}",
        "cause": failure_cause(err),
    }
    # Never instead of the error itself: without its note, the rank is judged by how it ended.
    with contextlib.suppress(OSError):
        (workdir / f"{_FAILED_NOTE}{rank}.json").write_text(json.dumps(note))


def _read_notes(workdir: Path) -> dict[int, _Note]:
    notes = {}
    for path in workdir.glob(f"{_FAILED_NOTE}*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found = json.loads(path.read_text())
            rank = int(path.stem.removeprefix(_FAILED_NOTE))
            cause = found.get("cause")
            notes[rank] = _Note(
                at=int(found["at"]),
                message=str(found["message"]),
                cause=cause if cause in get_args(FailureCause) else "infrastructure",
            )
    return notes


def _first_failure(
    failures: Mapping[int, ProcessFailure],
    notes: Mapping[int, _Note],
    world: int,
    first: int = 0,
    everyone: int | None = None,
) -> RankFailure:
    """The rank that failed first, not the lowest. A rank whose work raised noted when before
    it left the group, so before any other rank could fail for its leaving (a collective error
    on rank 0 after rank 1 ran out of memory): the earliest note is first. A rank that ended
    without a note (a signal: killed, out of host memory) is first when it is the one elastic
    saw end first (its `failures`): the others' errors followed from it. Elastic names one
    rank per poll (0.1 s), the lowest of those that ended in it: a rank killed within one poll
    of rank 0's own end is taken for rank 0's secondary error. `failures` and `notes` are by
    local rank; a member of many (`first`: its first global rank, of `everyone`) names its
    ranks by their global number."""
    total = everyone if everyone is not None else world
    for local, failure in failures.items():
        if local not in notes:
            rank = first + local
            return RankFailure(rank, f"rank {rank} of {total} ended with {_ending(failure)}")
    local = min(notes, key=lambda r: (notes[r].at, r))
    note, rank = notes[local], first + local
    return RankFailure(rank, f"rank {rank} of {total} failed: {note.message}", note.cause)


def _ending(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"signal {failure.signal_name()}"
    said = failure.error_file_data.get("message") if failure.error_file != _NOT_AVAILABLE else None
    said = said.get("message") if isinstance(said, dict) else said  # what `record` writes
    return f"exit code {failure.exitcode}" + (f": {said}" if said else "")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_main(work: Callable[..., object], workdir: str, *args: object) -> object:
    """A rank process: join the group, do `work(device, workdir, *args)`, leave (`run_ranks`).
    A preemption notice reaches the ranks from the parent only (the PREEMPT file, at a step's
    end on every rank at once): SIGTERM and SIGINT sent to the whole process group (systemd, a
    terminal's Ctrl-C) would otherwise kill them before the checkpoint the notice asks for."""
    _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_joined)(work, Path(workdir), *args)


def _joined(work: Callable[..., object], workdir: Path, *args: object) -> object:
    from runtime.logs import configure_logging
    from worker.settings import get_settings

    settings = get_settings()
    configure_logging(settings.log_format, settings.log_level)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    kind, ids = owned_devices(settings)
    device = rank_device(kind, ids, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collective = timedelta(seconds=settings.collective_timeout_seconds)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    beats: _Beats | None = None
    if world > local_world:
        # Across machines: the c10d rendezvous over the TCPStore global rank 0 serves.
        try:
            store, beats = _rendezvous(
                rank, world, local_world, settings.rendezvous_timeout_seconds
            )
        except GangError as err:
            _note_failure(workdir, local_rank, err)
            raise
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=collective,
            device_id=device_id,
        )
    else:
        dist.init_process_group(backend=backend, timeout=collective, device_id=device_id)
    log.info("rank %d of %d (pid %d) joined on %s", rank, world, os.getpid(), device)
    try:
        return work(device, workdir, *args)
    except Exception as err:
        named = _named_lost(err, beats) if beats is not None else err
        # Before leaving the group: a rank that fails because this one left notes later.
        _note_failure(workdir, local_rank, named)
        if named is not err:
            raise named from err
        raise
    finally:
        if beats is not None:
            beats.stop()
        dist.destroy_process_group()


# Keys of the rendezvous store: a rank's arrival, and its beat (a counter it raises every
# _BEAT_SECONDS while it lives); a peer whose beat stands still for _LOST_SECONDS is gone.
_JOINED = "trainctl/joined/"
_BEAT = "trainctl/beat/"
_BEAT_SECONDS = 0.5
_LOST_SECONDS = 3.0


class GangError(RuntimeError):
    """A phase across machines lost a member, or never had it: the message names which."""


def _member(rank: int, local_world: int) -> int:
    return rank // local_world


def _rendezvous(
    rank: int, world: int, local_world: int, timeout_seconds: float
) -> tuple[dist.TCPStore, _Beats]:
    """Meet every rank of every member at MASTER_ADDR:MASTER_PORT, as torchrun's c10d
    rendezvous does: global rank 0 serves the TCPStore there, the others connect to it
    (retrying until `timeout_seconds`), each says it arrived and waits for all. GangError
    naming the members that did not come within `timeout_seconds`."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    nodes = world // local_world
    timeout = timedelta(seconds=timeout_seconds)
    try:
        store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:
        raise GangError(
            f"rank {rank} of {world} (member {_member(rank, local_world)} of {nodes}) could not "
            f"reach the rendezvous at {host}:{port}, served by member 0, within "
            f"{timeout_seconds:g} s (TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS): {err}"
        ) from err
    store.set(f"{_JOINED}{rank}", "1")
    try:
        store.wait([f"{_JOINED}{r}" for r in range(world)], timeout)
    except (RuntimeError, OSError) as err:
        missing = sorted(
            {_member(r, local_world) for r in range(world) if not _has(store, f"{_JOINED}{r}")}
        )
        raise GangError(
            f"member(s) {', '.join(map(str, missing)) or '?'} of {nodes} did not join the "
            f"rendezvous at {host}:{port} within {timeout_seconds:g} s "
            f"(TRAINCTL_RENDEZVOUS_TIMEOUT_SECONDS): {err}"
        ) from err
    store.set_timeout(timedelta(seconds=_LOST_SECONDS))
    return store, _Beats(store, rank, world, local_world)


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except (RuntimeError, OSError):
        return False


class _Beats:
    """This rank's beat in the rendezvous store, raised from a thread of its own over a
    connection of its own, and the reading of the others' when a collective fails."""

    def __init__(self, store: dist.TCPStore, rank: int, world: int, local_world: int) -> None:
        import threading

        self.rank, self.world, self.local_world = rank, world, local_world
        self._host, self._port = store.host, store.port
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainctl-beat", daemon=True)
        self._thread.start()

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(
            self._host, self._port, is_master=False, timeout=timedelta(seconds=_LOST_SECONDS)
        )

    def _run(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            store = self._client()
            while not self._done.wait(_BEAT_SECONDS):
                store.add(f"{_BEAT}{self.rank}", 1)

    def stop(self) -> None:
        self._done.set()

    def lost(self) -> tuple[list[int], str | None]:
        """(the members with a rank whose beat stood still for _LOST_SECONDS, why the store
        itself cannot be read: then member 0, which serves it, is gone)."""
        try:
            store = self._client()
            keys = [f"{_BEAT}{r}" for r in range(self.world) if r != self.rank]
            before = [store.add(key, 0) for key in keys]
            time.sleep(_LOST_SECONDS)
            after = [store.add(key, 0) for key in keys]
        except (RuntimeError, OSError) as err:
            return [0], f"the rendezvous store it serves cannot be reached ({err})"
        ranks = [r for r in range(self.world) if r != self.rank]
        still = {
            _member(r, self.local_world)
            for r, a, b in zip(ranks, before, after, strict=True)
            if a == b
        }
        return sorted(still), None


def _named_lost(err: Exception, beats: _Beats) -> Exception:
    """`err` (a failed collective, most likely) with the members whose ranks stopped beating
    named, when some did; else `err` itself."""
    from worker.error import TrainingError

    if isinstance(err, TrainingError):
        return err  # the work's own failure, already named
    members, why = beats.lost()
    if not members:
        return err
    nodes = beats.world // beats.local_world
    named = ", ".join(str(m) for m in members)
    why = why or "its ranks stopped beating in the rendezvous store"
    return GangError(f"lost member {named} of {nodes} ({why}): {type(err).__name__}: {err}")
