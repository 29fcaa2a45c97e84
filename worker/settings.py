"""The worker's settings, read from `TRAINCTL_*` environment variables once per process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.dispatch import DEFAULT_QUEUE
from runtime.logs import LogFormat


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINCTL_", frozen=True)

    api_url: str = "http://127.0.0.1:8600"
    # The bearer token of `/internal/...`; workers hold no database credentials.
    worker_token: str = ""
    home: Path = Path("~/.trainctl")
    # Empty means the embedded broker: `filesystem://<home>/broker`.
    broker_url: str = ""
    queue: str = DEFAULT_QUEUE
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # None leaves torch's default (one thread per core).
    torch_threads: int | None = None
    heartbeat_seconds: float = 5.0
    # Log lines as text or as one JSON object per line; both carry run_id and attempt_id.
    log_format: LogFormat = "text"
    log_level: str = "INFO"
    # When set, the worker serves Prometheus metrics on this port (GET /metrics).
    metrics_port: int | None = None
    # At a phase's end, how long the worker waits for an unreachable service to take the
    # reports it spooled (and the finish) before it gives up and leaves them on disk for the
    # next worker process on this machine to send.
    spool_flush_seconds: float = 300.0
    # Fault injection for tests only (see worker/failpoint.py): "name@step,...". Empty in
    # production.
    failpoints: str = ""
    # Exists only so tests can prove that restoring the RNG matters (the negative control of
    # the bit-exact resume test): False leaves the random streams unrestored on resume, so a
    # resumed run with dropout differs from an uninterrupted one. Never set it in production.
    restore_rng: bool = True

    @field_validator("failpoints")
    @classmethod
    def _parse_failpoints(cls, value: str) -> str:
        from worker.failpoint import parse

        parse(value)  # fail fast on a typo: a test that arms nothing proves nothing
        return value

    @field_validator("home")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @property
    def spool_dir(self) -> Path:
        """`<home>/spool/<attempt_id>/`: reports the service could not take yet."""
        return self.home / "spool"

    @model_validator(mode="after")
    def _default_broker(self) -> WorkerSettings:
        if not self.broker_url:
            # frozen: the validator is the one place the default is derived from `home`.
            object.__setattr__(self, "broker_url", f"filesystem://{self.home / 'broker'}")
        return self


@functools.cache
def get_settings() -> WorkerSettings:
    return WorkerSettings()
