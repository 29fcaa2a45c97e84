"""Process management for the launchers: the embedded stack and waiting for an API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

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
