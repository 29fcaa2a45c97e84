"""The service's settings, read from the environment (prefix `TRAINCTL_`) in one place.

Defaults describe the embedded setup: everything under `TRAINCTL_HOME` (a SQLite database, a
filesystem broker, the artifact store). Production points `database_url` at Postgres and
`broker_url` at Redis; nothing else changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.bounds import MAX_BUDGET
from contracts.dispatch import DEFAULT_QUEUE
from contracts.paths import DataRoots, is_uri, split_roots
from runtime.logs import LogFormat
from runtime.store import normalize_root

DEFAULT_HOME = "~/.trainctl"
_DATABASE_SCHEMES = ("sqlite:", "postgresql:", "postgresql+psycopg:", "postgres:")
_BROKER_SCHEMES = ("filesystem:", "redis:", "rediss:", "amqp:", "memory:")


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINCTL_", extra="ignore")

    home: Path = Field(
        Path(DEFAULT_HOME),
        description="The embedded stack's folder: the defaults of the database, the broker and "
        "the artifact store lie under it.",
    )
    # The next three default to places under `home` (filled in by _derive_from_home).
    database_url: str = Field(
        "",
        description="postgresql+psycopg://user@host/db in production, or sqlite:///path.db.",
    )
    broker_url: str = Field(
        "",
        description="The Celery broker the service sends attempts and jobs on: "
        "redis://host:6379/0 in production, or filesystem:///folder (embedded).",
    )
    artifact_root: str = Field(
        "",
        description="The artifact store (checkpoints, token stores): a folder the service and "
        "every worker read at the same path, or s3://BUCKET/PREFIX on an S3-compatible store "
        "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION), which needs no shared disk.",
    )
    api_url: str = Field(
        "http://127.0.0.1:8600",
        description="The API's address: `trainctl up` sets it from its --host and --port and "
        "hands it to its workers; `serve` does not read it.",
    )
    queue: str = Field(
        default=DEFAULT_QUEUE,
        min_length=1,
        description="The broker queue the service sends work on (workers consume it).",
    )
    data_root: Path = Field(
        Path(),
        description="Relative paths in submitted workflows and jobs resolve against this "
        "folder; default: the first of the data roots when those are set, else the working "
        "directory.",
    )
    data_roots: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Every path the API accepts must resolve inside one of these folders or "
        'object store prefixes (s3://BUCKET/PREFIX), separated by os.pathsep (":"); default: '
        "the data root alone.",
    )
    lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="An attempt's lease: a worker not heard from this long has lost it, and "
        "the phase goes to another worker from the latest checkpoint.",
    )
    stall_seconds: float = Field(
        default=1800.0,
        gt=0,
        description="A running attempt whose worker keeps its lease but whose progress (steps, "
        "evals, checkpoints, preparation units) has not moved for this long is lost with "
        "cause `stalled`: the worker hangs. Longer than the slowest step, checkpoint or "
        "evaluation set a run may take.",
    )
    log_format: LogFormat = Field(
        "text",
        description="Log lines as text or as one JSON object per line (with run_id and "
        "attempt_id where known).",
    )
    log_level: str = Field("INFO", description="The lowest level logged.")
    outbox_interval_seconds: float = Field(
        default=2.0,
        gt=0,
        description="How often unsent broker messages (a broker outage) are sent again.",
    )
    reaper_interval_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the reaper looks for running attempts whose lease expired: a "
        "lost worker is noticed between lease_seconds and lease_seconds + this after its last "
        "report.",
    )
    job_timeout_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="A job (inspection, evaluation) running longer than this is sent to a "
        "worker again: its worker may have died (jobs hold no lease). The first outcome "
        "posted is the one kept.",
    )
    digest_wait_seconds: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long POST /runs (and a resume with a new initial checkpoint) waits for "
        "workers to hash its s3:// inputs whose digests are not known yet; past it the request "
        "answers 409 inputs_being_hashed naming each input and its digest job, to be sent "
        "again. 0: never wait.",
    )
    job_max_deliveries: int = Field(
        default=3,
        ge=1,
        le=MAX_BUDGET,
        description="A job is sent at most this many times: one whose worker went silent on it "
        "this often (killed by the job itself, as an out-of-memory kill does) fails instead of "
        "going out again.",
    )
    redispatch_seconds: float = Field(
        default=300.0,
        gt=0,
        description="An attempt still queued this long after its message went out, while a "
        "live worker that could take it runs nothing, is sent again: the broker lost the "
        "message (a Redis restarted without persistence, a purged queue).",
    )
    max_preemptions: int = Field(
        default=10,
        ge=0,
        le=MAX_BUDGET,
        description="A run's default budget of preemptions and lost workers (POST /runs may "
        "set its own).",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        le=MAX_BUDGET,
        description="A run's default budget of errors with cause `infrastructure` (POST /runs "
        "may set its own); other causes fail the run at once.",
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_from_home(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        home = Path(data.get("home") or DEFAULT_HOME).expanduser()
        data = dict(data)
        if not data.get("database_url"):
            data["database_url"] = f"sqlite:///{home.resolve() / 'trainctl.db'}"
        if not data.get("broker_url"):
            data["broker_url"] = f"filesystem://{home.resolve() / 'broker'}"
        if not data.get("artifact_root"):
            data["artifact_root"] = str(home / "artifacts")
        roots = data.get("data_roots")
        if isinstance(roots, str):
            roots = data["data_roots"] = split_roots(roots)
        if not data.get("data_root"):
            folders = [r for r in roots or () if not is_uri(str(r))]
            data["data_root"] = folders[0] if folders else Path.cwd()
        if not roots:
            data["data_roots"] = (data["data_root"],)
        return data

    @field_validator("home", "data_root")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("artifact_root", mode="before")
    @classmethod
    def _artifact_root(cls, value: str | Path) -> str:
        return normalize_root(value)

    @field_validator("data_roots", mode="before")
    @classmethod
    def _resolved(cls, value: object) -> object:
        if isinstance(value, str):
            value = split_roots(value)
        if isinstance(value, list | tuple):
            return tuple(dict.fromkeys(normalize_root(root) for root in value))
        return value

    @property
    def paths(self) -> DataRoots:
        """The rule every path the API accepts must pass (contracts.paths)."""
        return DataRoots.of(self.data_roots, artifact_root=self.artifact_root)

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not value.startswith(_DATABASE_SCHEMES):
            raise ValueError(
                f"TRAINCTL_DATABASE_URL {value!r} is not supported; use "
                "postgresql+psycopg://user@host/db or sqlite:///path/to/file.db"
            )
        return value

    @field_validator("broker_url")
    @classmethod
    def _check_broker_url(cls, value: str) -> str:
        if not value.startswith(_BROKER_SCHEMES):
            raise ValueError(
                f"TRAINCTL_BROKER_URL {value!r} is not supported; use redis://host:6379/0 "
                "or filesystem:///path/to/folder"
            )
        return value

    @field_validator("api_url")
    @classmethod
    def _check_api_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"TRAINCTL_API_URL {value!r} must start with http:// or https://")
        return value.rstrip("/")
