"""What travels between the service and a worker over `/internal/attempts/{id}/...`.

Every request a worker makes after its claim carries the attempt's `fencing_token`, the
claim's random secret: the service refuses reports whose secret is not the attempt's current
one (409 `superseded`), and any report from another worker token than the claimant's (403).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.bounds import (
    MAX_COUNT,
    MAX_HOSTNAME,
    MAX_NAME,
    MAX_PATH,
    MAX_SKIP_REASON,
    MAX_SKIP_REASONS,
    MAX_SKIPPED_EXAMPLE,
    MAX_SKIPPED_EXAMPLES,
    MAX_TASK,
    NO_NUL,
    NUL_REPLACED,
)
from contracts.signature import Digests
from contracts.workflow import (
    MAX_DEVICES,
    MAX_NODES,
    name_defaults_to_task,
    name_optional_in_schema,
)

# Steps and counts are stored in 32-bit columns.
Step = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]

# One request may carry at most this many metric points and this many bytes of body (the
# service answers 413 to more, before reading it); `metric_batches` splits points to fit both.
# Ingest costs less per point in larger batches (bench/metrics_reads.py: ~34,000 points/s by one
# sender in batches of 1,000, ~44,000 in batches of 5,000).
MAX_POINTS_PER_BATCH = 5000
MAX_REPORT_BYTES = 1 << 20
# The JSON of a point beyond its name's: braces, keys, a step and a float's shortest repr.
_POINT_JSON_BYTES = 80

FailureCause = Literal[
    "data",
    "config",
    "nan",
    "oom",
    "infrastructure",
    "restarts_exhausted",
    "signature_mismatch",
    "checkpoint",
    "disk_full",
]

# A member's index in an attempt across `nodes` workers (0: the only one, or the first).
Member = Annotated[int, Field(ge=0, lt=MAX_NODES)]


def _first(value: int) -> bool:
    """Left out of a body when 0, so a one-node attempt's messages stay as they were."""
    return value == 0


# A claim's secret: what `secrets.token_urlsafe(24)` makes, with room to spare.
FencingToken = Annotated[str, Field(min_length=1, max_length=64), NO_NUL]


class ClaimRequest(BaseModel):
    hostname: Annotated[str, Field(min_length=1, max_length=MAX_HOSTNAME), NO_NUL]
    pid: int = Field(ge=1, le=MAX_COUNT)
    # Chosen by the claimant once per claim and sent again with every retry of it: a retry
    # whose first try won (its answer lost on the way) gets the same claim back.
    nonce: Annotated[str, Field(min_length=1, max_length=64), NO_NUL]
    # Which member of an attempt across many workers this claimant is (the `member` of its
    # message); 0 for a one-node attempt.
    member: Member = Field(default=0, exclude_if=_first)


class CheckpointRef(BaseModel):
    """A complete checkpoint registered with the service."""

    path: Annotated[str, NO_NUL]
    step: Step  # global step (counted over the whole run)
    phase_index: int = Field(ge=0, le=MAX_COUNT)
    phase_step: Step


class Rendezvous(BaseModel):
    """Where the members of an attempt across machines meet: the TCPStore of torch.distributed's
    c10d rendezvous, served by the first member's global rank 0 on its host at a port chosen
    for the attempt."""

    host: Annotated[str, Field(min_length=1, max_length=MAX_HOSTNAME), NO_NUL]
    port: int = Field(ge=1, le=65535)


class Claim(BaseModel):
    """The service's answer to a successful claim: everything the worker needs to train."""

    attempt_id: str
    run_id: str
    attempt_number: int
    fencing_token: FencingToken
    lease_seconds: float
    workflow: dict[str, Any]  # normalised workflow (contracts.workflow.Workflow)
    signature: str
    digests: Digests
    initial_checkpoint: str | None = None
    phase_index: int
    # The checkpoint to start from: this phase's latest (resume) or the previous phase's final.
    resume_from: CheckpointRef | None = None
    artifact_dir: str  # <artifact_root>/runs/<run_id>
    # The encoding rules the run was signed with (contracts.workflow.ENCODER_VERSION); a worker
    # that encodes otherwise refuses the attempt. None: a run signed before it was signed.
    encoder_version: int | None = None
    # The torch.distributed ranks this attempt runs on: the workflow's resources for the
    # phase, or the count the run was last resumed with.
    devices: int = Field(default=1, ge=1, le=MAX_DEVICES)
    # Across machines: `nodes` members of `devices` ranks each, this one `node_rank` (its
    # ranks are node_rank * devices + 0 .. devices - 1 of nodes * devices); all of them join
    # the process group at `rendezvous`. One node: 1, 0 and None.
    nodes: int = Field(default=1, ge=1, le=MAX_NODES)
    node_rank: Member = 0
    rendezvous: Rendezvous | None = None

    @model_validator(mode="after")
    def _a_member_of_its_nodes(self) -> Claim:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} is not one of {self.nodes} nodes")
        if self.nodes > 1 and self.rendezvous is None:
            raise ValueError(f"an attempt across {self.nodes} nodes needs a rendezvous")
        return self


class Preparing(BaseModel):
    """A data file being tokenized into its store: the file, and the share of it read."""

    file: Annotated[str, Field(max_length=MAX_PATH), NO_NUL]
    fraction: float = Field(ge=0.0, le=1.0)


class Heartbeat(BaseModel):
    fencing_token: FencingToken
    step: Step
    # A counter that only grows while the worker works (steps, eval batches, checkpoint
    # writes, preparation units): the service judges a stall by it, not by the heartbeat.
    progress: int = Field(default=0, ge=0, le=2**63 - 1)
    # While the attempt tokenizes a data file into its token store, before its first step;
    # left out of the body otherwise.
    preparing: Preparing | None = Field(default=None, exclude_if=lambda value: value is None)
    # The member of an attempt across many workers that beats (each keeps its own lease, so
    # the service can tell a dead member); left out for 0.
    member: Member = Field(default=0, exclude_if=_first)


class HeartbeatAnswer(BaseModel):
    # "stop": the attempt was superseded or the run cancelled; stop at once, write nothing more.
    # "pause": checkpoint now, then finish with status "paused" (a resume continues from it).
    action: Literal["continue", "stop", "pause"] = "continue"
    lease_seconds: float


class MetricPoint(BaseModel):
    name: str
    step: int  # range-checked per item by the service, which reports bad points individually
    value: float


class MetricBatch(BaseModel):
    fencing_token: FencingToken
    points: list[MetricPoint] = Field(max_length=MAX_POINTS_PER_BATCH)


def metric_batches(points: Sequence[MetricPoint]) -> list[list[MetricPoint]]:
    """`points` in order, cut into batches of at most MAX_POINTS_PER_BATCH points whose JSON
    stays under MAX_REPORT_BYTES, as UTF-8 JSON encoders write it (httpx's, pydantic's)."""
    budget = MAX_REPORT_BYTES - 1024  # the fencing token and the envelope
    sizes: dict[str, int] = {}
    batches: list[list[MetricPoint]] = []
    batch: list[MetricPoint] = []
    used = 0
    for point in points:
        size = sizes.get(point.name)
        if size is None:
            size = sizes[point.name] = _json_string_bytes(point.name) + _POINT_JSON_BYTES
        if batch and (len(batch) == MAX_POINTS_PER_BATCH or used + size > budget):
            batches.append(batch)
            batch, used = [], 0
        batch.append(point)
        used += size
    if batch:
        batches.append(batch)
    return batches


def _json_string_bytes(text: str) -> int:
    """At least the bytes of `text` as a UTF-8 JSON string: quoted, a quote or backslash
    escaped by one more byte, a control character by at most five (`\\u0001`)."""
    escaped = sum(1 for c in text if c < " " or c in '"\\')
    return len(text.encode()) + 5 * escaped + 2


# Why an eval set skips a record it cannot score, as `EvalResult.skipped_records` keys it, and
# how people read each: a line that is not JSON; JSON that is not a record the set's task reads
# (not an object, a missing or non-string field, an unknown shape, text in a supervised set or
# a supervised record in a text set); a record without target tokens. A record too long for
# the set's sequence_length is skipped too, counted apart in `oversized_records` (as before).
SKIP_REASONS: dict[str, str] = {
    "malformed_json": "malformed JSON",
    "wrong_shape": "wrong shape",
    "no_target": "no target tokens",
}
# A set that skipped more than this share of its records (too long ones included) is marked
# where its results are shown (`trainctl runs eval`, `trainctl eval`, the dashboard): its
# number speaks for noticeably fewer records than its file holds.
SKIPPED_MARK_SHARE = 0.02

SkipReason = Annotated[str, Field(min_length=1, max_length=MAX_SKIP_REASON), NO_NUL]
SkippedExample = Annotated[str, Field(max_length=MAX_SKIPPED_EXAMPLE), NUL_REPLACED]


def skipped_share(records: int, oversized: int, skipped: Mapping[str, int]) -> float:
    """The share of a set's records that it skipped (too long or unscorable): 0 for none."""
    left_out = oversized + sum(skipped.values())
    return left_out / (records + left_out) if left_out else 0.0


class EvalResult(BaseModel):
    """One eval set's evaluation at one step: token-weighted, target-only cross-entropy. Stored
    and answered by the set's `name` (contracts.workflow.EvalSpec; default: its task).
    `records` are those scored; the others are counted in `oversized_records` and, by reason,
    in `skipped_records`, the first of them named in `skipped_examples`."""

    model_config = ConfigDict(json_schema_extra=name_optional_in_schema)

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL]
    task: Annotated[str, Field(max_length=MAX_TASK), NO_NUL]
    step: Step
    phase: Annotated[str, Field(max_length=MAX_NAME), NO_NUL]
    cross_entropy: float
    perplexity: float
    records: Count
    target_tokens: Count
    oversized_records: Count = 0
    # Optional, as a worker from before them reports neither.
    skipped_records: dict[SkipReason, Count] = Field(default={}, max_length=MAX_SKIP_REASONS)
    skipped_examples: list[SkippedExample] = Field(default=[], max_length=MAX_SKIPPED_EXAMPLES)

    @model_validator(mode="before")
    @classmethod
    def _name_defaults_to_task(cls, data: Any) -> Any:
        # A report spooled by a worker from before eval sets had names.
        return name_defaults_to_task(data)


class EvalBatch(BaseModel):
    fencing_token: FencingToken
    results: list[EvalResult]


class CheckpointReport(BaseModel):
    fencing_token: FencingToken
    checkpoint: CheckpointRef


class Finish(BaseModel):
    fencing_token: FencingToken
    status: Literal["succeeded", "failed", "preempted", "paused"]
    step: Step
    cause: FailureCause | None = None
    message: Annotated[str, NUL_REPLACED] | None = None
    # The member of an attempt across many workers that ends: member 0 finishes the attempt,
    # another says how its own part ended. Left out for 0.
    member: Member = Field(default=0, exclude_if=_first)


class Accepted(BaseModel):
    accepted: int


class WorkerPing(BaseModel):
    """What a worker process says about itself every few seconds (`/internal/workers/ping`),
    so that the service knows it is there even while it has no attempt. `pid` is the process
    that claims attempts (Celery's solo pool trains in the worker's own process)."""

    hostname: Annotated[str, Field(min_length=1, max_length=MAX_HOSTNAME), NO_NUL]
    pid: int = Field(ge=1, le=MAX_COUNT)
    version: Annotated[str, Field(min_length=1, max_length=64), NO_NUL]
    queue: Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL]
    # What the worker can run a phase on: `devices` of `device_kind` ("cpu", "cuda"); it
    # consumes the queues of 1 to `devices` ranks (contracts.dispatch.served_queues).
    devices: int = Field(default=1, ge=1, le=MAX_DEVICES)
    device_kind: Literal["cpu", "cuda"] = "cpu"
    # Its key (contracts.dispatch.worker_key): it consumes its own queue
    # (contracts.dispatch.worker_queue), where the service sends the attempts it places on it.
    # None from a worker that predates placement: it is listed, never placed on.
    worker: (
        Annotated[str, Field(min_length=1, max_length=120, pattern=r"^[A-Za-z0-9_-]+$")] | None
    ) = None
    # The host other workers reach it at (TRAINCTL_ADVERTISE_ADDRESS, default its hostname):
    # as member 0 of an attempt across machines, the rendezvous the others' ranks meet at.
    # Left out when not said (the service then uses the hostname).
    address: Annotated[str, Field(min_length=1, max_length=MAX_HOSTNAME), NO_NUL] | None = Field(
        default=None, exclude_if=lambda value: value is None
    )


# A removal's reason is a sentence with a path or two in it; a longer one is cut by the worker.
MAX_REMOVAL_REASON = 2000
RemovalStatus = Literal["deleted", "quarantined"]


class CheckpointRemoval(BaseModel):
    """A registered checkpoint of this run the worker took out of use on disk: retention
    deleted it (`deleted`), or it failed verification and was renamed aside (`quarantined`).
    Posted to `/internal/attempts/{id}/checkpoints/removals` after the fact, spooled like every
    report while the service is down."""

    fencing_token: FencingToken
    step: Step
    status: RemovalStatus
    reason: Annotated[str, Field(min_length=1, max_length=MAX_REMOVAL_REASON), NUL_REPLACED]


class CheckpointRegistered(BaseModel):
    """The answer to a checkpoint registration: the steps of this run's checkpoints that
    another run still needs as its initial checkpoint (it has not succeeded and has no
    checkpoint of its own), and the best checkpoint of each eval set the workflow's
    `checkpoint.keep_best` names, at the moment of the answer. Retention keeps them (pinned)."""

    accepted: int
    pinned_steps: list[int] = []
