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
class RankFailure:
    rank: int
    message: str
    # As on one device (worker.error.failure_cause): a rank's out-of-memory is `oom`.
    cause: FailureCause = "infrastructure"


def run_ranks(
    work: Callable[..., object],
    world: int,
    args: tuple[object, ...],
    *,
    workdir: Path,
    stop_requested: Callable[[], bool],
    handed_over: Callable[[], None],
) -> tuple[object, RankFailure | None]:
    """Start `world` rank processes, each running `work(device, workdir, *args)` in the
    process group (`rank_main`; `work` a module-level function, which pickles), and wait for
    them: (rank 0's return value, None) when every rank ended well, (None, the first failure)
    when one did not (the others are ended then). `handed_over` is called once rank 0 creates
    REPORTING in `workdir`, or when the ranks end; when `stop_requested()` turns true, PREEMPT
    is created there."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    port = free_port()
    envs = {
        rank: {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for rank in range(world)
    }
    with _signals_kept():
        context = start_processes(
            name="trainctl-rank",
            entrypoint=rank_main,
            args={rank: (work, str(workdir), *args) for rank in range(world)},
            envs=envs,
            logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "logs")),
        )
    log.info("started %d ranks (master port %d)", world, port)
    told = reporting = False
    try:
        while (result := context.wait(timeout=0.5, period=0.1)) is None:
            if not reporting and (workdir / REPORTING).exists():
                reporting = True
                handed_over()
            if not told and stop_requested():
                told = True
                (workdir / PREEMPT).touch()
    finally:
        context.close()
    if not reporting:
        handed_over()
    if result.is_failed():
        return None, _first_failure(result.failures, _read_notes(workdir), world)
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
    failures: Mapping[int, ProcessFailure], notes: Mapping[int, _Note], world: int
) -> RankFailure:
    """The rank that failed first, not the lowest. A rank whose work raised noted when before
    it left the group, so before any other rank could fail for its leaving (a collective error
    on rank 0 after rank 1 ran out of memory): the earliest note is first. A rank that ended
    without a note (a signal: killed, out of host memory) is first when it is the one elastic
    saw end first (its `failures`): the others' errors followed from it. Elastic names one
    rank per poll (0.1 s), the lowest of those that ended in it: a rank killed within one poll
    of rank 0's own end is taken for rank 0's secondary error."""
    for rank, failure in failures.items():
        if rank not in notes:
            return RankFailure(rank, f"rank {rank} of {world} ended with {_ending(failure)}")
    rank = min(notes, key=lambda r: (notes[r].at, r))
    note = notes[rank]
    return RankFailure(rank, f"rank {rank} of {world} failed: {note.message}", note.cause)


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
    kind, ids = owned_devices(settings)
    device = rank_device(kind, ids, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=settings.collective_timeout_seconds),
        device_id=device if device.type == "cuda" else None,
    )
    log.info("rank %d of %d (pid %d) joined on %s", rank, world, os.getpid(), device)
    try:
        return work(device, workdir, *args)
    except Exception as err:
        # Before leaving the group: a rank that fails because this one left notes later.
        _note_failure(workdir, rank, err)
        raise
    finally:
        dist.destroy_process_group()
