"""Process management for the launchers: the embedded stack and waiting for an API."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import httpx

log = logging.getLogger(__name__)

# Seconds a worker gets to checkpoint and exit after SIGTERM before it is killed.
WORKER_STOP_SECONDS = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: list[str], *, env: Mapping[str, str], log: Path | None = None) -> subprocess.Popen:
    """Start `python -m cli <args>` in its own process group (so a signal to the group reaches
    Celery's children too), logging to `log` when given."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - closed when the child exits
    return subprocess.Popen(
        [sys.executable, "-m", "cli", *args],
        env={**os.environ, **env},
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        start_new_session=True,
    )


def stop(process: subprocess.Popen, *, grace: float = WORKER_STOP_SECONDS) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """This environment without the caller's own TRAINCTL_* settings, plus `env`: a child
    configured by `env` alone (tests and benchmarks run several stacks side by side)."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("TRAINCTL_")}
    return {**inherited, "PYTHONUNBUFFERED": "1", **env}


class Proc:
    """A `python -m cli ...` child configured by `env` alone (child_env), in its own process
    group, its output in a log file; for the tests and benchmarks that run whole stacks."""

    def __init__(self, args: list[str], *, env: Mapping[str, str], log: Path) -> None:
        self.log = log
        self._out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "cli", *args],
            env=child_env(env),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to its group, SIGKILL after `timeout` seconds."""
        stop(self.popen, grace=timeout)
        self._out.close()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(url: str, *, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} while starting")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f} s")


class Child(Protocol):
    """What a Supervisor needs of a process (subprocess.Popen has it)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


def describe_exit(code: int) -> str:
    """`exit code 3`, or `signal SIGKILL` for a child a signal ended (Popen's negative codes)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


@dataclass(frozen=True)
class Backoff:
    """The pause before restarting a child that exited: `first` seconds, doubling with each
    exit in a row up to `cap`; a child that lived `healthy_after` seconds starts the count
    over (a worker that crashes at once does not spin; one that ran for hours is back in a
    second)."""

    first: float = 1.0
    cap: float = 60.0
    healthy_after: float = 60.0

    def delay(self, exits_in_a_row: int) -> float:
        return min(self.cap, self.first * 2 ** (exits_in_a_row - 1))


C = TypeVar("C", bound=Child)


@dataclass
class _Slot(Generic[C]):
    index: int
    child: C
    started_at: float
    exits_in_a_row: int = 0
    restart_at: float | None = None  # set while the child is dead and waits for its restart


class Supervisor(Generic[C]):
    """Keeps `count` children running, as a process supervisor would: a child that exits, by
    itself or killed, is started again after `backoff`; each exit is logged with its exit code
    or signal, each restart counted (`restarts`, `on_restart`). close() stops the children and
    no restart happens after it. `poll` is one pass at the clock's time; `watch` runs passes
    from a thread. `start_child(index)` starts the child of a slot."""

    def __init__(
        self,
        start_child: Callable[[int], C],
        count: int,
        *,
        stop_child: Callable[[C], None],
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_restart: Callable[[], None] = lambda: None,
    ) -> None:
        self._start_child, self._stop_child = start_child, stop_child
        self.backoff = backoff or Backoff()
        self._clock, self._on_restart = clock, on_restart
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        now = clock()
        self._slots = [_Slot(i, start_child(i), started_at=now) for i in range(count)]
        self.restarts = 0

    @property
    def children(self) -> list[C]:
        return [slot.child for slot in self._slots]

    def poll(self) -> None:
        """Notice children that exited and restart those whose pause is over."""
        with self._lock:
            if self._closed.is_set():
                return
            now = self._clock()
            for slot in self._slots:
                if slot.restart_at is None:
                    self._notice_exit(slot, now)
                elif now >= slot.restart_at:
                    self._restart(slot, now)

    def _notice_exit(self, slot: _Slot[C], now: float) -> None:
        code = slot.child.poll()
        if code is None:
            return
        lived = now - slot.started_at
        slot.exits_in_a_row = 1 if lived >= self.backoff.healthy_after else slot.exits_in_a_row + 1
        delay = self.backoff.delay(slot.exits_in_a_row)
        slot.restart_at = now + delay
        log.warning(
            "worker %d (pid %d) exited with %s after %.1f s; restarting it in %.1f s",
            slot.index,
            slot.child.pid,
            describe_exit(code),
            lived,
            delay,
        )

    def _restart(self, slot: _Slot[C], now: float) -> None:
        try:
            child = self._start_child(slot.index)
        except OSError as err:  # e.g. out of processes or memory: try again later
            slot.exits_in_a_row += 1
            delay = self.backoff.delay(slot.exits_in_a_row)
            slot.restart_at = now + delay
            log.error(
                "worker %d could not be started (%s); next try in %.1f s", slot.index, err, delay
            )
            return
        slot.child, slot.started_at, slot.restart_at = child, now, None
        self.restarts += 1
        self._on_restart()
        log.warning(
            "worker %d restarted as pid %d (%d restart(s) so far)",
            slot.index,
            slot.child.pid,
            self.restarts,
        )

    def watch(self, interval: float = 0.5) -> None:
        """Poll every `interval` seconds from a daemon thread until close()."""

        def loop() -> None:
            while not self._closed.wait(interval):
                try:
                    self.poll()
                except Exception:  # supervision must outlive any one failed poll
                    log.exception("supervising the workers failed; trying again")

        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop restarting, then stop every child (stop_child: SIGTERM, then SIGKILL)."""
        with self._lock:
            self._closed.set()
        if self._thread is not None:
            self._thread.join()
        for slot in self._slots:
            self._stop_child(slot.child)
