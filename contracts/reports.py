"""What travels between the service and a worker over `/internal/attempts/{id}/...`.

Every request a worker makes after its claim carries the attempt's `fencing_token`; the
service refuses reports whose token is not the attempt's current one (409 `superseded`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from contracts.signature import Digests
from contracts.workflow import MAX_COUNT

# One request may carry at most this many metric points; the reporter splits larger batches.
MAX_POINTS_PER_BATCH = 1000

FailureCause = Literal[
    "data",
    "config",
    "nan",
    "oom",
    "infrastructure",
    "restarts_exhausted",
    "signature_mismatch",
]


class ClaimRequest(BaseModel):
    hostname: str
    pid: int


class CheckpointRef(BaseModel):
    """A complete checkpoint registered with the service."""

    path: str
    step: Step  # global step (counted over the whole run)
    phase_index: int = Field(ge=0, le=MAX_COUNT)
    phase_step: Step


class Claim(BaseModel):
    """The service's answer to a successful claim: everything the worker needs to train."""

    attempt_id: str
    run_id: str
    attempt_number: int
    fencing_token: int
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


# Steps are stored in 32-bit columns.
Step = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class Heartbeat(BaseModel):
    fencing_token: int
    step: Step


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
    fencing_token: int
    points: list[MetricPoint] = Field(max_length=MAX_POINTS_PER_BATCH)


class EvalResult(BaseModel):
    """One task's evaluation at one step: token-weighted, target-only cross-entropy."""

    task: str = Field(max_length=64)
    step: Step
    phase: str = Field(max_length=200)
    cross_entropy: float
    perplexity: float
    records: int
    target_tokens: int
    oversized_records: int = 0


class EvalBatch(BaseModel):
    fencing_token: int
    results: list[EvalResult]


class CheckpointReport(BaseModel):
    fencing_token: int
    checkpoint: CheckpointRef


class Finish(BaseModel):
    fencing_token: int
    status: Literal["succeeded", "failed", "preempted", "paused"]
    step: Step
    cause: FailureCause | None = None
    message: str | None = None


class Accepted(BaseModel):
    accepted: int
