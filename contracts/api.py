"""What the public API accepts and answers: the request and response models the service
validates and answers with, and that a client reads answers into (the worker protocol lives
in contracts.reports)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    ValidationInfo,
    computed_field,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from contracts.bounds import (
    MAX_BUDGET,
    MAX_COUNT,
    MAX_ID,
    MAX_NAME,
    MAX_TAG,
    NO_NUL,
    SHA256_HEX,
    UserPath,
)
from contracts.documented import DocumentedAs
from contracts.reports import Preparing
from contracts.workflow import MAX_DEVICES, Plan, Workflow

MAX_RUNS_PAGE = 500
# Tags per run, the characters of a note, and the runs one comparison takes.
MAX_TAGS = 32
MAX_NOTE = 10_000
MAX_COMPARED = 8
# Run priorities lie in [-MAX_PRIORITY, MAX_PRIORITY].
MAX_PRIORITY = 1_000_000


class RunStatus(StrEnum):
    """A run's status; the transitions between them are service.lifecycle's."""

    QUEUED = "queued"
    RUNNING = "running"
    RECOVERING = "recovering"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


def check_tag(value: str) -> str:
    """A tag is one word: no whitespace and no comma (a list of tags is written with commas,
    in the CLI and the dashboard), at most MAX_TAG characters."""
    if any(c.isspace() or c in ",\0" for c in value):
        raise PydanticCustomError(
            "invalid_tag",
            "tag '{tag}' holds whitespace, a comma or a NUL; a tag is one word such as "
            "'baseline' or 'lr-sweep'",
            {"tag": value},
        )
    return value


# The schema's pattern says what check_tag refuses (its message is the one answered).
Tag = Annotated[
    str,
    Field(min_length=1, max_length=MAX_TAG, json_schema_extra={"pattern": r"^[^\s,\u0000]*$"}),
    AfterValidator(check_tag),
]

# A workflow document as a request carries it: received as a JSON object, so that the service
# reports every problem at once, each with its JSON path (service.runs.workflow.parse_workflow);
# published as the Workflow's JSON Schema.
WorkflowDocument = Annotated[dict[str, Any], DocumentedAs(Workflow)]


class Status(BaseModel):
    status: str


class WorkflowValidation(BaseModel):
    valid: bool
    plan: Plan


class WorkflowPublic(BaseModel):
    id: str
    name: str
    # The normalised document (defaults filled in), whose SHA-256 is `id`.
    workflow: WorkflowDocument
    plan: Plan
    created_at: datetime


class CheckpointOf(BaseModel):
    """Another run's registered checkpoint as an initial checkpoint: the one at `step`, or the
    best checkpoint of its eval set `best` (service.checkpoints.registry: of its steps with a
    usable checkpoint, the one whose evaluation of the set has the lowest cross-entropy),
    resolved to its step when the run is created."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(min_length=1, max_length=MAX_ID)
    step: int | None = Field(None, ge=0, le=MAX_COUNT)
    best: Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL] | None = Field(
        None, validate_default=True
    )

    # A field's check, not the model's: errors keep their path (`initial_checkpoint
    # .CheckpointOf.best`), where a model validator would rename the model in every one.
    @field_validator("best")
    @classmethod
    def _step_or_best(cls, best: str | None, info: ValidationInfo) -> str | None:
        if "step" in info.data and (info.data["step"] is None) == (best is None):
            raise ValueError(
                'give exactly one of "step" (a step with a checkpoint) or "best" (an eval '
                "set, whose best checkpoint is taken)"
            )
        return best


# A local safetensors file or model directory the service can read (relative paths resolve
# against data_root), or another run's registered checkpoint.
InitialCheckpointIn = UserPath | CheckpointOf


# RunCreate's rule in JSON Schema: a workflow document, or a stored workflow's id.
_GIVES_WORKFLOW: JsonDict = {
    "required": ["workflow"],
    "properties": {"workflow": {"type": "object"}},
}
_GIVES_WORKFLOW_ID: JsonDict = {
    "required": ["workflow_id"],
    "properties": {"workflow_id": {"type": "string"}},
}


class RunCreate(BaseModel):
    """A run of a workflow: the document itself (`workflow`) or a stored one's id
    (`workflow_id`), exactly one of them. The schema says it as `not` (both, or neither), which
    is `oneOf` of the two without making generated clients see a union of two models: they
    read a `oneOf` beside `properties` as one and lose the model itself."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "not": {
                "anyOf": [
                    {"allOf": [_GIVES_WORKFLOW, _GIVES_WORKFLOW_ID]},
                    {"not": {"anyOf": [_GIVES_WORKFLOW, _GIVES_WORKFLOW_ID]}},
                ]
            }
        },
    )

    workflow: WorkflowDocument | None = None
    workflow_id: str | None = Field(None, min_length=1, max_length=SHA256_HEX)
    initial_checkpoint: InitialCheckpointIn | None = None
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL] | None = None
    # New attempts after errors with cause `infrastructure`; default TRAINCTL_MAX_RESTARTS.
    max_restarts: int | None = Field(None, ge=0, le=MAX_BUDGET)
    # New attempts after preemptions and lost workers; default TRAINCTL_MAX_PREEMPTIONS.
    max_preemptions: int | None = Field(None, ge=0, le=MAX_BUDGET)
    # Placement order: higher first, then the oldest attempt; a queued attempt may preempt
    # running ones of strictly lower priority (they checkpoint, yield and queue again).
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @model_validator(mode="after")
    def _one_workflow(self) -> RunCreate:
        if (self.workflow is None) == (self.workflow_id is None):
            raise ValueError('give exactly one of "workflow" (a document) or "workflow_id"')
        return self


class RunUpdate(BaseModel):
    """What PATCH /runs/{id} changes; an omitted field stays as it is. `tags` replaces the
    run's set (duplicates once; `[]` removes every tag); `note` null or "" removes it."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL] | None = None
    tags: Annotated[list[Tag], Field(max_length=MAX_TAGS)] | None = None
    note: Annotated[str, Field(max_length=MAX_NOTE), NO_NUL] | None = None
    # The run's placement priority (its queued attempts are placed again in the new order).
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)


class RunResume(BaseModel):
    """What a resume must reproduce the stored signature with; an omitted field means "as
    stored" (the stored workflow; the stored initial checkpoint's digest, not re-hashed).
    `devices` is not signed: the ranks the new attempt and every later one run on (each of
    the remaining phases' grad_accum must be a multiple of it); omitted, the count the run
    was last resumed with, else the workflow's."""

    model_config = ConfigDict(extra="forbid")

    workflow: WorkflowDocument | None = None
    initial_checkpoint: InitialCheckpointIn | None = None
    devices: int | None = Field(None, ge=1, le=MAX_DEVICES)


class CheckpointSummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    path: str
    phase_index: int


class CheckpointPublic(CheckpointSummary):
    phase_step: int
    attempt_id: str
    created_at: datetime
    # `usable`, or what its worker reported doing with it: `deleted` (retention) or
    # `quarantined` (failed verification, renamed aside), with why and when.
    status: str
    reason: str | None
    removed_at: datetime | None


class BestCheckpoint(BaseModel):
    """An eval set's best checkpoint: of the run's steps with a usable checkpoint, the one
    whose evaluation of the set has the lowest cross-entropy (the earliest on ties); what
    `checkpoint.keep_best` keeps and `{"run", "best"}` names. `step` None: no step of the set
    has both. `best_eval_step`: the set's best evaluation of all, which may lie at a step
    without a checkpoint (`note` then says so)."""

    name: str
    kept: bool  # named by the workflow's checkpoint.keep_best: retention keeps it
    step: int | None
    cross_entropy: float | None
    best_eval_step: int
    best_eval_cross_entropy: float
    note: str | None = None


class CheckpointsPublic(BaseModel):
    checkpoints: list[CheckpointPublic]
    count: int
    # Per eval set with a scored evaluation, by name.
    best: list[BestCheckpoint] = []


class AttemptPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    number: int
    phase_index: int
    # The torch.distributed ranks it runs on (fixed when it was queued).
    devices: int = 1
    status: str
    worker_hostname: str | None
    worker_pid: int | None
    claimed_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    cause: str | None
    message: str | None
    # The workers it runs on at once (a multi-node phase), each with `devices` devices.
    nodes: int = 1
    # Set when the service asked it to checkpoint and yield to a higher-priority attempt
    # (it then ends `paused` with cause `priority`, not charged to max_preemptions).
    yield_requested_at: datetime | None = None
    # How many times its message was sent again while it waited: no worker claimed it within
    # TRAINCTL_REDISPATCH_SECONDS though one was free (the broker had lost it).
    redispatches: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def started_at(self) -> datetime | None:
        """When a worker claimed it (`claimed_at`, the name earlier clients read)."""
        return self.claimed_at


class InitialCheckpointFrom(BaseModel):
    """Another run's checkpoint a run started from: that run and step, and when it was named
    as `{"run", "best"}`, the eval set whose best checkpoint it was when the run was created."""

    run: str
    step: int
    best: str | None = None


class RunPublic(BaseModel):
    id: str
    name: str
    # Set with PATCH /runs/{id}: tags sorted, the note as written (None: none).
    tags: list[str] = []
    note: str | None = None
    workflow_id: str
    status: RunStatus
    cause: str | None
    message: str | None
    phase: str | None
    phase_index: int
    step: int
    total_steps: int
    signature: str
    plan: Plan
    initial_checkpoint: str | None
    # Where the initial checkpoint came from when it is another run's (None otherwise).
    initial_checkpoint_from: InitialCheckpointFrom | None = None
    latest_checkpoint: CheckpointSummary | None
    attempts: list[AttemptPublic]
    # Budget use, counted from the attempts: restarts after `infrastructure` errors, and
    # preemptions (preempted or lost attempts).
    restarts: int
    max_restarts: int
    preemptions: int
    max_preemptions: int
    # Seconds lost to recovery: from each preempted or lost attempt's end (a lost one's lease
    # expiry) to the claim of the attempt after it.
    recovery_seconds: float
    # Set while a pause waits for the running worker to checkpoint and stop.
    pause_requested_at: datetime | None
    # Placement priority (higher first), and while its attempt is queued, its place in the
    # placement order (1: next; GET /queue).
    priority: int = 0
    queue_position: int | None = None
    # The count the run was last resumed with (POST /runs/{id}/resume `devices`), which every
    # later attempt runs on; None: as the workflow asks for each phase.
    devices: int | None = None
    # The newest attempt is queued and no live worker (heard from within the lease period) of
    # the service's queue can take it: none is live, or none owns as many devices as the
    # attempt needs. Nothing will take it until such a worker starts (GET /workers).
    waiting_for_worker: bool
    # Why, in a sentence, while waiting_for_worker; None otherwise.
    waiting_reason: str | None = None
    # The running attempt is tokenizing a data file into its token store before its first
    # step (the file, and the share of it read), as its last heartbeat said.
    preparing: Preparing | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class ItemErrorPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    index: int  # the item's position in the request
    error: str


class BatchAccepted(BaseModel):
    """contracts.reports.Accepted (a worker that reads only `accepted` reads this too), plus
    the items that were refused while the rest were stored."""

    accepted: int
    errors: list[ItemErrorPublic] = []


class RunsPublic(BaseModel):
    runs: list[RunPublic]
    count: int
    # Pass as `cursor` for the next page; None on the last page.
    next_cursor: str | None = None


class WorkerAssignment(BaseModel):
    """What the scheduler placed on a worker: an attempt (hidden from a user token when the
    run is another owner's), its member number, and whether a worker claimed it yet."""

    attempt_id: str | None
    run_id: str | None
    member: int
    priority: int
    placed_at: datetime
    claimed: bool


class WorkerPublic(BaseModel):
    """A worker process the service has heard from (a claim, a heartbeat or its ping)."""

    hostname: str
    pid: int
    version: str
    queue: str | None
    # Heard from within the lease period.
    live: bool
    first_seen_at: datetime
    last_seen_at: datetime
    # Whether it is running an attempt, whoever's.
    busy: bool
    # The attempt it is running, and its run; None when it runs none, or (to a user token) when
    # the run is another owner's.
    attempt_id: str | None
    run_id: str | None
    # What its ping says it can run a phase on: `devices` of `device_kind` ("cpu", "cuda").
    # None for a worker heard from only by its claims (counted as one device).
    devices: int | None = None
    device_kind: str | None = None
    # Its own queue's key (from its ping; None: heard from only by claims, never placed on),
    # and the attempt the service placed on it (claimed or not yet), as member `member`.
    key: str | None = None
    assignment: WorkerAssignment | None = None


class QueuedAttemptPublic(BaseModel):
    """A queued attempt in placement order, and why it waits (GET /queue)."""

    position: int
    attempt_id: str
    run_id: str
    run_name: str
    priority: int
    owner_id: str | None
    devices: int
    nodes: int
    queued_at: datetime | None
    # "placed" (its members' workers have its message), or a sentence: no worker big enough,
    # the owner's quota, behind higher ones, a gang waiting for free workers, preempting X.
    reason: str


class QueuePublic(BaseModel):
    attempts: list[QueuedAttemptPublic]
    count: int


class WorkersPublic(BaseModel):
    workers: list[WorkerPublic]
    count: int  # workers ever heard from (all pages)
    live: int  # of which heard from within the lease period


class ComparedPhase(BaseModel):
    name: str
    first_step: int
    last_step: int


class ComparedRun(BaseModel):
    """A run of a comparison, in the order asked for."""

    id: str
    name: str
    status: RunStatus
    step: int
    total_steps: int
    signature: str
    tags: list[str]
    note: str | None
    phases: list[ComparedPhase]
    created_at: datetime
    finished_at: datetime | None


class EvalAt(BaseModel):
    """One evaluation of one set: its step, cross-entropy and perplexity."""

    step: int
    cross_entropy: float | None
    perplexity: float | None


class PhaseEval(BaseModel):
    """One eval set over one phase. `start`: its latest evaluation at or before the phase's
    first update (the previous phase's end, or the baseline for the first phase); `end`: its
    evaluation at the phase's last step, which workers always run, or while the phase trains
    (or when that one is missing) the latest inside the phase, `complete` false; null before
    the phase's first evaluation. `change`: the end's perplexity against the start's, in
    percent (negative: better; positive after a supervised phase on a pretraining set:
    forgetting)."""

    start: EvalAt | None
    end: EvalAt | None
    complete: bool
    change: float | None


class PhaseEvals(BaseModel):
    """A phase of the run (its steps first_step..last_step) and each eval set over it, in the
    order of `EvalByPhase.sets`."""

    index: int
    name: str
    objective: str
    role: str
    first_step: int
    last_step: int
    sets: list[PhaseEval]


class EvalSetRef(BaseModel):
    name: str
    task: str
    baseline: EvalAt | None  # step 0, before the first update


class EvalByPhase(BaseModel):
    """`GET /runs/{id}/eval/phases`: the phases x eval sets matrix (forgetting phase by
    phase): each set's value at each phase's end and its change over the phase."""

    run_id: str
    sets: list[EvalSetRef]
    phases: list[PhaseEvals]


class EvalPoint(BaseModel):
    """One evaluation of one eval set as `GET /runs/{id}/eval` answers it: `records` scored,
    the `target_tokens` the loss was taken over, the records left out as too long
    (`oversized_records`) and, by reason, as unscorable (`skipped_records`: contracts.reports
    .SKIP_REASONS). Non-finite values are null."""

    step: int
    phase: str
    cross_entropy: float | None
    perplexity: float | None
    records: int
    target_tokens: int
    oversized_records: int
    skipped_records: dict[str, int]


class EvalSetSummary(BaseModel):
    """One eval set of a run: its `task`, `baseline` (the step-0 evaluation, before the first
    update; null without one), `latest` (the highest step), `best` (the lowest cross-entropy,
    the earliest on ties; null while none is finite), `history` by step (thinned to
    `max_points` when asked), and the first records its latest evaluation skipped, as
    "file:line: reason"."""

    task: str
    baseline: EvalPoint | None
    latest: EvalPoint
    best: EvalPoint | None
    history: list[EvalPoint]
    skipped_examples: list[str] = []


class EvalSummaryPublic(BaseModel):
    """`GET /runs/{id}/eval`: each eval set of the run, by name (`tasks`; an eval set is named
    after its task unless the workflow names it)."""

    run_id: str
    tasks: dict[str, EvalSetSummary]


class MetricSeries(BaseModel):
    """One metric as columns: `steps` ascending, and the value at each (null: not finite)."""

    steps: list[int]
    values: list[float | None]


class MetricSeriesPublic(RootModel[dict[str, MetricSeries]]):
    """`GET /runs/{id}/metrics`: each metric series of the run, by name."""


class ComparedEval(BaseModel):
    """One run's results on one eval set: `baseline` (step 0), `final` (the highest step: the
    latest while the run trains), `best` (lowest cross-entropy, the earliest on ties), and the
    change in percent of its final and best perplexity against the first run's (None for the
    first run, or when either has none) and of its final against its own baseline."""

    run_id: str
    baseline: EvalAt | None
    final: EvalAt | None
    best: EvalAt | None
    final_vs_first: float | None
    best_vs_first: float | None
    final_vs_baseline: float | None


class ComparedEvalSet(BaseModel):
    """An eval set any of the runs has results for, with a row per run (in the runs' order;
    every field None for a run without results on it)."""

    name: str
    task: str
    runs: list[ComparedEval]


class InputDifference(BaseModel):
    """One signed input that differs between the runs, named as a refused resume names it
    (contracts.signature.diff_components: `optimizer.adamw_lr`, `data["/d/a.jsonl"].sha256`),
    with each run's value in the runs' order (None: the run has no such input), its `group`
    (InputGroup.name) and each run's change against the first: `added` (the first has no
    such input), `removed` (this run has none), `changed`, or None (the same; the first)."""

    field: str
    values: list[Any]
    group: str = "other"
    changes: list[str | None] = []


class InputGroup(BaseModel):
    """The differences of one kind, in the order a comparison shows them: `data` (data files
    added, removed or changed), `phases` (per-phase fields), `optimizer`, `evals`, `other`
    (model, tokenizer, seed, checkpoints, initial weights ...). `summary` counts them."""

    name: str
    title: str
    count: int
    summary: str


class InputDiff(BaseModel):
    """What differs in the runs' inputs, from their stored signature components: `identical`
    when nothing does (the runs trained on the same workflow, tokenizer, data and initial
    weights), else each differing field against the first run."""

    identical: bool
    same_signature: bool
    differences: list[InputDifference]  # by group (in `groups`' order), then field
    groups: list[InputGroup] = []  # the groups with differences
    summary: str


class RunComparison(BaseModel):
    runs: list[ComparedRun]
    evals: list[ComparedEvalSet]
    inputs: InputDiff


class LedgerSource(BaseModel):
    """One data source of a phase in the token ledger: planned against trained. Trained counts
    are the phase's so far (null when its worker did not count them: a phase trained before
    the ledger, or resumed from a checkpoint written before it)."""

    name: str
    objective: str
    # Its tokens count as replay: continued_pretrain text in a post-training phase.
    replay: bool
    planned_tokens: int
    planned_share: float  # of the phase's planned tokens
    # Envelope tokens (what the plan counts), their share of the phase's trained so far, the
    # target tokens the loss was taken over, and how many times the source was gone through.
    trained_tokens: int | None
    trained_share: float | None
    target_tokens: int | None
    epochs: float | None


class LedgerPhase(BaseModel):
    index: int
    name: str
    objective: str
    role: str
    first_step: int
    last_step: int
    planned_tokens: int
    trained_tokens: int | None
    planned_replay_share: float
    replay_share: float | None  # of the phase's tokens trained so far
    sources: list[LedgerSource]


class LedgerPublic(BaseModel):
    """`GET /runs/{id}/ledger`: per phase and source, tokens planned and trained, and the
    run's realised replay share against its plan's (contracts.workflow.Plan defines both
    shares: replay of all tokens, and of post-training tokens). Realised shares are of the
    tokens trained so far; null while any phase begun has no counts."""

    run_id: str
    step: int
    planned_tokens: int
    trained_tokens: int | None
    planned_replay_tokens: int
    replay_tokens: int | None
    planned_replay_share: float
    replay_share: float | None
    planned_post_training_replay_share: float
    post_training_replay_share: float | None
    phases: list[LedgerPhase]


# Who a token is: `admin` (everything, tokens and the audit trail included), `user` (its own
# runs and jobs), `viewer` (reads every run and job), `worker` (the internal API only).
TokenRole = Literal["admin", "user", "viewer", "worker"]


class TokenPublic(BaseModel):
    """A token as listed: never its secret nor the secret's hash."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    role: TokenRole
    created_at: datetime
    rotated_at: datetime | None
    revoked_at: datetime | None
    # The most devices its runs' attempts may hold placed or running at once (None:
    # unlimited).
    max_devices: int | None = None


class TokensPublic(BaseModel):
    tokens: list[TokenPublic]
    count: int


class TokenIssued(BaseModel):
    """A new secret, shown this once: store it (mode 0600 if in a file)."""

    token: TokenPublic
    secret: str


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=200), NO_NUL]
    role: TokenRole = "user"
    # A cap on the devices its runs hold at once (None: unlimited).
    max_devices: int | None = Field(None, ge=0, le=MAX_COUNT)


class TokenUpdate(BaseModel):
    """What PATCH /tokens/{id} changes; `max_devices` null removes the cap."""

    model_config = ConfigDict(extra="forbid")

    max_devices: int | None = Field(None, ge=0, le=MAX_COUNT)


class WhoAmI(BaseModel):
    id: str
    name: str
    role: TokenRole
    can_read: bool = Field(description="may read runs, jobs and workers (GET)")
    can_write: bool = Field(description="may create runs and jobs, and control its own runs")
    sees_all: bool = Field(description="reads every run and job, not only its own")
    is_admin: bool = Field(description="may manage tokens and read the audit trail")
