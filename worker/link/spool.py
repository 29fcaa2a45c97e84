"""Reports the service could not take yet, on local disk, in order.

`<TRAINCTL_HOME>/spool/<attempt_id>/` holds one JSON file per report, named by a sequence
number that only grows (`000000000042.json`), each `{"kind": "metrics" | "evals" |
"checkpoint" | "removal" | "finish", "report": <the request body>}`: the body carries its
fencing token, so a report sent late is still refused if the attempt is no longer its sender's.
A file is written as `.part`, fsynced and renamed, so a listed file is always whole; it is
deleted once the service has taken it.

A live process holds its spool with an exclusive `flock` on `.lock` (released by the kernel when
the process dies, SIGKILL included), so a process draining leftovers never sends a live
process's reports under it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from contracts.reports import CheckpointRemoval, CheckpointReport, EvalBatch, Finish, MetricBatch
from worker.files import fsync_dir

log = logging.getLogger(__name__)

Report = MetricBatch | EvalBatch | CheckpointReport | CheckpointRemoval | Finish
Kind = Literal["metrics", "evals", "checkpoint", "removal", "finish"]

_MODELS: dict[str, type[BaseModel]] = {
    "metrics": MetricBatch,
    "evals": EvalBatch,
    "checkpoint": CheckpointReport,
    "removal": CheckpointRemoval,
    "finish": Finish,
}
_LOCK = ".lock"
_SUFFIX = ".json"


def kind_of(report: Report) -> Kind:
    if isinstance(report, MetricBatch):
        return "metrics"
    if isinstance(report, EvalBatch):
        return "evals"
    if isinstance(report, CheckpointReport):
        return "checkpoint"
    if isinstance(report, CheckpointRemoval):
        return "removal"
    return "finish"


MEMBER_SPOOL = ".member-"


def spool_name(attempt_id: str, member: int) -> str:
    """The spool directory's name of `member` of attempt `attempt_id`: the attempt's id for
    member 0 (as for a one-node attempt), `<attempt_id>.member-<k>` for the others."""
    return attempt_id if member == 0 else f"{attempt_id}{MEMBER_SPOOL}{member}"


class SpoolError(Exception):
    """A spooled file that does not parse (it was changed by hand, or the disk lies)."""


class Spool:
    """One attempt's spool directory. Nothing is created on disk until the first `append`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock: int | None = None
        self._next = 0

    @property
    def attempt_id(self) -> str:
        # A member's spool of an attempt across many workers is `<attempt_id>.member-<k>`
        # (`spool_name`): two members on one machine never share a spool.
        return self.directory.name.split(MEMBER_SPOOL, 1)[0]

    def acquire(self, *, wait: bool) -> bool:
        """Hold the spool exclusively, creating its directory; False (without waiting) when
        another live process holds it and `wait` is False."""
        if self._lock is not None:
            return True
        lock = self.directory / _LOCK
        while True:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # a drainer removed the directory meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            # A drainer that held the lock may have removed the directory under our open file.
            try:
                current = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        self._lock = fd
        entries = self.entries()
        self._next = int(entries[-1].stem) + 1 if entries else 0
        return True

    def entries(self) -> list[Path]:
        """The spooled files, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.suffix == _SUFFIX)

    def append(self, report: Report) -> Path:
        """Write `report` after every spooled one, durably (fsync of the file and directory)."""
        self.acquire(wait=True)
        path = self.directory / f"{self._next:012d}{_SUFFIX}"
        part = path.with_suffix(".part")
        body = {"kind": kind_of(report), "report": report.model_dump(mode="json")}
        with open(part, "w") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
        fsync_dir(self.directory)
        self._next += 1
        return path

    def read(self, path: Path) -> Report:
        try:
            body = json.loads(path.read_text())
            report = _MODELS[body["kind"]].model_validate(body["report"])
        except (ValueError, KeyError, TypeError) as err:
            raise SpoolError(f"spooled report {path} does not parse: {err}") from err
        assert isinstance(
            report, (MetricBatch, EvalBatch, CheckpointReport, CheckpointRemoval, Finish)
        )
        return report

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def set_aside(self, path: Path) -> Path:
        """Rename a file that does not parse out of the listing, kept for a human."""
        target = path.with_suffix(".bad")
        os.replace(path, target)
        return target

    def release(self) -> None:
        """Let go of the spool; its directory is removed when nothing is left in it."""
        if self._lock is None:
            return
        if not self.entries() and not any(self.directory.glob("*.bad")):
            # Removed while locked: a process waiting on the lock sees its file gone and
            # starts over (see `acquire`).
            shutil.rmtree(self.directory, ignore_errors=True)
        os.close(self._lock)
        self._lock = None

    def discard(self) -> None:
        """Delete everything spooled (the attempt is no longer ours: nothing more is sent)."""
        if self._lock is None and not self.directory.is_dir():
            return
        self.acquire(wait=True)
        dropped = len(self.entries())
        if dropped:
            log.info("dropping %d spooled reports of attempt %s", dropped, self.attempt_id)
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
