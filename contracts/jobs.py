"""Jobs that are not training: dataset inspection, token store preparation and standalone
evaluation.

All read data or run a model, so all run on workers (the service never imports torch): the
API stores a job and answers 202 with its id, a worker runs it and posts the result back, and
`GET` on the job returns it. The CLI runs the same worker functions locally.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, WithJsonSchema

from contracts.bounds import NUL_REPLACED, UserPath
from contracts.documented import DocumentedAs
from contracts.reports import EvalResult
from contracts.workflow import InspectionGate, Name, Objective, PositiveInt

JobKind = Literal["inspection", "evaluation", "preparation", "digest"]
JobStatus = Literal["queued", "running", "succeeded", "failed"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InspectRequest(_Request):
    """Inspect one data file with the exact tokenizer and encoder of training."""

    path: UserPath
    tokenizer: UserPath
    objective: Objective
    sequence_length: PositiveInt


class PrepareRequest(_Request):
    """Build one data file's token store ahead of time, the one a phase reading it with this
    tokenizer, objective and sequence_length would otherwise build before its first step."""

    path: UserPath
    tokenizer: UserPath
    objective: Objective
    sequence_length: PositiveInt

    @property
    def fit(self) -> int | None:
        """What the store's records are fitted to: nothing for text, as training reads it."""
        return None if self.objective == "continued_pretrain" else self.sequence_length


class EvaluateRequest(_Request):
    """Evaluate a checkpoint (any `save_pretrained` directory: a run's, or a pre-SFT model) on
    one task's data, outside any run."""

    checkpoint: UserPath
    task: Objective
    data: UserPath
    # The eval set the result is named after (EvalSpec.name); default: the task.
    name: Name | None = None
    # Default: the tokenizer saved in the checkpoint directory.
    tokenizer: UserPath | None = None
    sequence_length: PositiveInt
    batch_size: PositiveInt = 8


class DigestRequest(_Request):
    """Hash an input in an object store for the service, which never downloads one: `uri` is an
    object (a file) or a prefix (a directory: every object under `uri/`), `fingerprint` what
    the service saw of it (object_fingerprint), for the log and the result."""

    uri: UserPath
    fingerprint: str


class DigestResult(BaseModel):
    """What a worker hashed: the content digest of `uri` (contracts.signature.sha256_path's rule
    over the bytes streamed) and the fingerprint of the objects it read (object_fingerprint of
    the listing taken before hashing, checked unchanged after), which the service records it
    under: the one it asked for, unless the objects changed in between."""

    uri: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    objects: int
    size: int


def object_fingerprint(entries: Iterable[tuple[str, str | None, int]]) -> str:
    """What an object store input is known by short of reading it: SHA-256 over its objects'
    sorted `relpath\0etag\0size\n` lines (relpath "" for a single object). A new ETag or
    size (an object rewritten) or an object added or removed under a prefix changes it; S3 gives
    every write a new ETag, so equal fingerprints mean equal bytes."""
    lines = sorted(f"{rel}\0{etag or ''}\0{size}\n" for rel, etag, size in entries)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


class LengthStats(BaseModel):
    """Token lengths over the records of a file (as encoded, before any fitting)."""

    count: int
    min: int
    mean: float
    p50: int
    p90: int
    p99: int
    max: int


class SegmentSurvival(BaseModel):
    """How the segments of one role (and elasticity) fare when records are fitted, over the
    segments of that role in records training would take: `kept` whole, `trimmed` (part kept)
    or `dropped`. `refused` counts those in records training refuses (too long even after
    fitting, or without a target): nothing of those is trained on. Non-elastic segments are
    never trimmed or dropped, so for them kept / (kept + refused) is their survival rate."""

    role: str
    elastic: str | None
    segments: int
    kept: int
    trimmed: int
    dropped: int
    refused: int


class RecordProblem(BaseModel):
    line: int
    reason: str


class InspectionReport(BaseModel):
    path: str
    objective: Objective
    sequence_length: int
    # Records by format: text, pair, chat, segmented.
    formats: dict[str, int]
    # Every non-blank line: records, and lines that are not records.
    records: int
    # Records training would take (trimmed or not), and those it would refuse: too long, of
    # the wrong kind for the objective, or lines that are not records.
    fit: int
    refused: int
    # Records whose elastic segments were trimmed or dropped to fit.
    trimmed: int
    tokens_trimmed: int
    segments_dropped: int
    zero_target: int
    duplicates: int
    # Plain {source, target} records too long to fit: cut from the tail, as a naive encoder
    # does, each would lose the end of its source (often the question).
    source_end_lost_if_truncated: int
    # "source", "target", "total": lengths as encoded (total = what must fit sequence_length+1).
    lengths: dict[str, LengthStats]
    segments: list[SegmentSurvival] = []
    # The first problems, with their line numbers (refused, zero target, duplicate).
    problems: list[RecordProblem] = []
    # Pretraining text: all tokens (EOS-joined) and how many windows of the geometry they make.
    text_tokens: int | None = None
    # `--write-fit`: where the records that fit were written, and how many.
    fit_path: str | None = None
    fit_written: int | None = None
    # As an eval set of the objective's task at sequence_length would count them: it scores
    # the `fit` records and skips the others, too long apart (contracts.reports.EvalResult's
    # fields of the same names). Optional: a worker from before them reports neither.
    oversized_records: int = 0
    skipped_records: dict[str, int] = {}

    def gate_failures(self, gate: InspectionGate) -> list[str]:
        """Why this report does not meet `gate`, one sentence each; empty when it does."""
        failures = []
        if self.refused:
            failures.append(f"{self.refused} records cannot be encoded within sequence_length")
        if self.zero_target:
            failures.append(f"{self.zero_target} records have no target tokens")
        if self.records:
            trimmed, duplicates = self.trimmed / self.records, self.duplicates / self.records
            if trimmed > gate.max_trimmed_share:
                failures.append(
                    f"{trimmed:.1%} of records were trimmed to fit, more than "
                    f"max_trimmed_share {gate.max_trimmed_share:.1%}"
                )
            if duplicates > gate.max_duplicate_share:
                failures.append(
                    f"{duplicates:.1%} of records are duplicates, more than "
                    f"max_duplicate_share {gate.max_duplicate_share:.1%}"
                )
        return failures


class PreparedStore(BaseModel):
    """A prepared token store: where it is, what it holds, and whether this job built it."""

    path: str
    store: str  # the store's directory, under <artifact_root>/tokens/
    records: int
    tokens: int
    # False when a complete store was already there (built by a run, an inspection or an
    # earlier preparation): then only the file's digest and the store's meta were checked.
    built: bool
    seconds: float


# A job's time, answered as Python's isoformat writes it (`+00:00`, where pydantic would write
# `Z`), as jobs always have been; a date-time in the document.
JobTime = Annotated[
    datetime,
    PlainSerializer(datetime.isoformat, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
# What a job was asked and what it found, answered as stored: described by their models, but
# not read through them (a result stored by an older worker still answers as it was written).
JobRequest = Annotated[
    dict[str, Any], DocumentedAs(InspectRequest | PrepareRequest | EvaluateRequest)
]
JobResult = Annotated[dict[str, Any], DocumentedAs(InspectionReport | PreparedStore | EvalResult)]


class Job(BaseModel):
    """A job as the API returns it."""

    id: str
    kind: JobKind
    status: JobStatus
    # An InspectRequest, PrepareRequest or EvaluateRequest by `kind`, its paths resolved (a
    # DigestRequest for a `digest` job, which only run creation makes and only workers see).
    request: JobRequest
    # An InspectionReport, a PreparedStore or an EvalResult (contracts.reports), once
    # succeeded (a DigestResult for a `digest` job).
    result: JobResult | None = None
    error: str | None = None
    created_at: JobTime
    finished_at: JobTime | None = None
    # How many times its message went out to a worker (the first time, and again each time its
    # worker went silent on it for the service's job timeout).
    deliveries: int = 0


class JobOutcome(BaseModel):
    """What a worker posts to `/internal/jobs/{id}/result`."""

    status: Literal["succeeded", "failed"]
    result: dict[str, Any] | None = None
    error: Annotated[str, Field(max_length=4000), NUL_REPLACED] | None = None
