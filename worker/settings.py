"""The worker's settings, read from `TRAINCTL_*` environment variables once per process."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.dispatch import DEFAULT_QUEUE
from contracts.paths import DataRoots, split_roots
from runtime.logs import LogFormat
from runtime.store import normalize_root
from worker.failpoint_spec import parse


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINCTL_", frozen=True)

    api_url: str = Field("http://127.0.0.1:8600", description="The API the worker reports to.")
    # A secret: `**********` in every repr, str and dump; `get_secret_value()` where it is sent.
    worker_token: SecretStr = Field(
        SecretStr(""),
        description="The worker's bearer token (role `worker`) for the API's internal routes; "
        "workers hold no database credentials.",
    )
    worker_token_file: Path | None = Field(
        None,
        description="A file holding the worker token, read at each request instead of "
        "worker_token (which stays the fallback while the file cannot be read): the embedded "
        "stack passes its <home>/worker-token, which rotating that token rewrites, so no worker "
        "needs a restart.",
    )
    home: Path = Field(
        Path("~/.trainctl"),
        description="The worker's folder: the default broker and artifact store, and the spool "
        "of reports the service could not take yet.",
    )
    broker_url: str = Field(
        "",
        description="The Celery broker the worker consumes: redis://host:6379/0 in production; "
        "empty: the embedded broker folder under home.",
    )
    artifact_root: str = Field(
        "",
        description="The artifact store, as the service names it (a folder, or "
        "s3://BUCKET/PREFIX): jobs keep their token stores under it; an attempt takes the "
        "root from its claim.",
    )
    cache_dir: Path = Field(
        Path(),
        description="This worker's local cache of an object store's artifacts (checkpoints "
        "staged and downloaded, token stores, input objects); empty: <home>/cache. Unused "
        "with a folder as the artifact store.",
    )
    cache_max_bytes: int = Field(
        100 * 2**30,
        ge=0,
        description="The cache's bound in bytes: past it, the least recently used entries are "
        "evicted (never one in use). Size it to at least the largest checkpoint plus the "
        "token stores of a phase.",
    )
    queue: str = Field(DEFAULT_QUEUE, description="The broker queue the worker consumes.")
    data_roots: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="The folders a claim's or a job's files must resolve inside, as the "
        "service reads them (os.pathsep-separated); checked again before anything is read. "
        "Empty: the data root.",
    )
    data_root: Path | None = Field(
        None,
        description="With no data roots, the one folder files must resolve inside; unset: the "
        "working directory.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description='Where to train; "auto": CUDA when available, else the CPU.'
    )
    devices: str = Field(
        default="",
        pattern=r"^\s*(\d+|(\d+\s*,\s*)+\d*)?\s*$",
        description="The devices this worker owns, for phases of more than one rank: a count "
        '("2": on CPU, two gloo ranks) or CUDA indices ("0,1"; "3," for device 3 alone). '
        "Empty: every visible GPU, or one CPU rank. It consumes the queues of 1 to that many "
        "ranks.",
    )
    collective_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="How long a rank waits in one collective (a gradient all-reduce, the "
        "step's order) for the others before the attempt fails: longer than the slowest eval "
        "or checkpoint wait rank 0 makes the others sit through.",
    )
    rendezvous_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="A phase across many workers: how long its members wait for each other "
        "to join the process group (torch.distributed's c10d rendezvous) before the attempt "
        "fails and recovers from its latest checkpoint.",
    )
    advertise_address: str | None = Field(
        default=None,
        max_length=255,
        description="The host other workers reach this one at (its pings say it): when it is "
        "the first member of a phase across many workers, the others' ranks meet at this "
        "address. Empty: its hostname.",
    )
    torch_threads: int | None = Field(
        None, description="torch's CPU threads; unset: torch's default (one per core)."
    )
    heartbeat_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the lease keeper renews the attempt's lease (and the loop "
        "flushes buffered metric points): well under the service's lease_seconds.",
    )
    log_format: LogFormat = Field(
        "text",
        description="Log lines as text or as one JSON object per line; both carry run_id and "
        "attempt_id.",
    )
    log_level: str = Field("INFO", description="The lowest level logged.")
    metrics_port: int | None = Field(
        None,
        description="When set, the worker serves Prometheus metrics on this port (GET /metrics).",
    )
    spool_flush_seconds: float = Field(
        300.0,
        description="At a phase's end, how long the worker waits for an unreachable service to "
        "take the reports it spooled (and the finish) before it leaves them on disk for the "
        "next worker process on this machine to send.",
    )
    abandon_seconds: float = Field(
        default=600.0,
        gt=0,
        description="A worker told to stop (its attempt was lost as stalled, or given away) "
        "whose attempt has not ended this long after is hung: it ends its process (exit 70) "
        "for its supervisor to start a fresh one. Longer than the slowest step or checkpoint "
        "wait.",
    )
    # Test knobs: `test_*` settings are refused unless TRAINCTL_TESTING=1, so that a variable
    # left in a production environment stops the worker at start instead of killing it
    # mid-phase or training it inexactly.
    testing: bool = Field(
        False, description="Allows the test knobs (the `test_` settings); never set in production."
    )
    test_failpoints: str = Field(
        "",
        description='Test knob: fault injection, "point@step,slow_point@step=seconds,...".',
    )
    test_skip_rng_restore: bool = Field(
        False,
        description="Test knob: leaves the random streams unrestored on resume (the negative "
        "control of the bit-exact resume test).",
    )

    @field_validator("test_failpoints")
    @classmethod
    def _parse_failpoints(cls, value: str) -> str:
        parse(value)  # fail fast on a typo: a test that arms nothing proves nothing
        return value

    @model_validator(mode="after")
    def _test_knobs_only_when_testing(self) -> WorkerSettings:
        knobs = {
            "TRAINCTL_TEST_FAILPOINTS": bool(self.test_failpoints),
            "TRAINCTL_TEST_SKIP_RNG_RESTORE": self.test_skip_rng_restore,
        }
        if not self.testing and (set_knobs := [name for name, on in knobs.items() if on]):
            names = " and ".join(set_knobs)
            what = "is a test knob" if len(set_knobs) == 1 else "are test knobs"
            raise ValueError(
                f"{names} {what}, refused because TRAINCTL_TESTING is not 1: unset it in this "
                "environment (a test that means it sets TRAINCTL_TESTING=1 too)"
            )
        return self

    @field_validator("home", "cache_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("artifact_root", mode="before")
    @classmethod
    def _artifact_root(cls, value: str | Path) -> str:
        return normalize_root(value) if value else ""

    @field_validator("data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            value = split_roots(value)
        if isinstance(value, list | tuple):
            return tuple(str(root) if isinstance(root, Path) else root for root in value)
        return value

    def paths(self, artifact_root: str | None = None) -> DataRoots:
        """The rule for what this worker reads; checkpoints may also lie in the artifact store
        at `artifact_root` (default: this worker's)."""
        roots = self.data_roots or (self.data_root or Path.cwd(),)
        return DataRoots.of(roots, artifact_root=artifact_root or self.artifact_root)

    @property
    def spool_dir(self) -> Path:
        """`<home>/spool/<attempt_id>/`: reports the service could not take yet."""
        return self.home / "spool"

    @model_validator(mode="after")
    def _default_broker(self) -> WorkerSettings:
        # frozen: the validator is the one place the defaults are derived from `home`.
        if not self.broker_url:
            object.__setattr__(self, "broker_url", f"filesystem://{self.home / 'broker'}")
        if not self.artifact_root:
            object.__setattr__(self, "artifact_root", str(self.home / "artifacts"))
        if self.cache_dir == Path():
            object.__setattr__(self, "cache_dir", self.home / "cache")
        return self


@functools.cache
def get_settings() -> WorkerSettings:
    return WorkerSettings()
