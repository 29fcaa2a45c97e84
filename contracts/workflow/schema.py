"""The workflow document's schema: the pydantic models of a workflow, its phases, data
sources, eval sets and settings, their defaults and limits, and the normalised form that is
stored and signed.

Each field is checked here on its own; what one field means for another is validation.py's.
"""

from __future__ import annotations

import copy
import math
from pathlib import PurePath
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contracts.bounds import MAX_COUNT, MAX_NAME, NO_NUL, UserPath

Objective = Literal[
    "continued_pretrain",
    "summarization",
    "instruction_tuning",
    "qa_reasoning",
    "retrieval_planning",
]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
SUPERVISED_OBJECTIVES: tuple[str, ...] = tuple(o for o in OBJECTIVES if o != "continued_pretrain")
# "train": the phase trains on its data (a pretraining stage, or a supervised phase).
# "replay": a continued_pretrain phase that returns to earlier pretraining data after
# post-training has begun, so that the model keeps what it learned; all of it counts as replay.
Role = Literal["train", "replay"]

# The version of the rules that turn records into token ids and loss masks (worker/data/encode.py,
# docs/data.md). Part of every run's signature: a run never resumes under other encoding rules.
# Bump it whenever the same record would encode differently.
ENCODER_VERSION = 3

# Counts and sizes are stored in 32-bit integer columns (contracts.bounds); a larger one is a
# typo, not a plan.
PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME), NO_NUL]


def name_defaults_to_task(data: Any) -> Any:
    """An eval set's (or an eval result's) `name`, when not given, is its `task`: the one
    rule, for the workflow's eval entries and for the results workers report."""
    if isinstance(data, dict) and data.get("name") is None and "task" in data:
        return {**data, "name": data["task"]}
    return data


class _Strict(BaseModel):
    # Python's JSON parser accepts Infinity and NaN; a learning rate of either only fails later,
    # on a GPU, so they are refused here.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """Either a transformers config (llama-style; `model_type` defaults to "llama") or a local
    directory holding a pretrained model (`save_pretrained` output)."""

    config: dict[str, Any] | None = None
    pretrained: UserPath | None = None


class OptimizerSpec(_Strict):
    """Muon for the 2-D hidden weights, AdamW for everything else (embeddings, head, norms)."""

    muon_lr: float = Field(0.02, gt=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_weight_decay: float = Field(0.0, ge=0)
    adamw_lr: float = Field(3e-3, gt=0)
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)


class CheckpointSpec(_Strict):
    every_steps: PositiveInt = 100
    # At least two, so a corrupt newest checkpoint always has a predecessor to fall back to.
    keep_last: int = Field(2, ge=2, le=MAX_COUNT)
    # Eval sets (by name) whose best checkpoint retention keeps beside the last `keep_last`:
    # of the steps with a checkpoint, the one whose evaluation of the set has the lowest
    # cross-entropy. Left out of the normalised form (and so of the signature) when empty:
    # workflows written before it keep their signature.
    keep_best: list[Name] = Field([], exclude_if=lambda value: not value)


class EvalSpec(_Strict):
    # What the set's results are stored and answered under; by default its task. Two sets of
    # one task (a QA mixture and a RAG set, say) need names of their own.
    name: Name
    task: Objective
    data: UserPath
    every_steps: PositiveInt = 100
    # One geometry for the whole run, so that every point of a task's history is comparable:
    # by default the longest sequence_length of the workflow (phases and their sources).
    sequence_length: PositiveInt | None = None
    # Rows per forward pass; the number does not depend on it (only memory and speed do).
    batch_size: PositiveInt = 8

    @model_validator(mode="before")
    @classmethod
    def _name_defaults_to_task(cls, data: Any) -> Any:
        return name_defaults_to_task(data)


def perplexity(cross_entropy: float) -> float:
    """exp(ce), saturating instead of raising for an untrained model's large losses."""
    return math.exp(cross_entropy) if cross_entropy < 700 else math.inf


class DataSource(_Strict):
    """One source of a phase's mixture. `objective`, `sequence_length` and `microbatch_size`
    default to the phase's: a replay source of pretraining text inside a supervised phase sets
    `objective: continued_pretrain` and the pretraining stage's geometry, which must fill the
    same token envelope (`sequence_length x microbatch_size = microbatch_tokens`)."""

    path: UserPath
    # A share of *tokens* (of the phase's envelope tokens), relative to the other sources.
    weight: float = Field(1.0, gt=0)
    # Names the source's metrics (`loss/<name>`); by default the file name without suffixes.
    name: (
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] | None
    ) = None
    objective: Objective | None = None
    sequence_length: PositiveInt | None = None
    microbatch_size: PositiveInt | None = None


class InspectionGate(_Strict):
    """Limits a phase's data must meet before its first step (checked by the worker with the
    same encoder as training; see docs/data.md). Refused records and records with no target
    tokens always stop training; these limits add what is allowed of the rest."""

    # Share of records whose elastic segments had to be trimmed or dropped to fit.
    max_trimmed_share: float = Field(1.0, ge=0, le=1)
    # Share of records that repeat an earlier record exactly.
    max_duplicate_share: float = Field(1.0, ge=0, le=1)


class Schedule(_Strict):
    """Learning-rate multiplier over a phase: linear warmup, then either cosine decay or
    warmup-stable-decay (WSD: flat, then a linear decay over the last `decay_fraction`)."""

    kind: Literal["wsd", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0, le=MAX_COUNT)
    decay_fraction: float = Field(0.2, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


# The most torch.distributed ranks one phase may ask of one worker (a machine of GPUs).
MAX_DEVICES = 64


class Resources(_Strict):
    """What one attempt of a phase runs on: `devices` ranks of torch.distributed on one worker
    (DDP: each rank holds the whole model and takes its share of every step's microbatches).
    Not part of the run's identity: the same global batch is trained whatever the count, so
    a run pre-empted on 8 devices may go on on 4 (`POST /runs/{id}/resume` `devices`)."""

    devices: int = Field(1, ge=1, le=MAX_DEVICES)
    # "replicate": DDP, every rank holds the whole model and optimizer state. "fsdp": FSDP2
    # (`fully_shard`, per transformer block), each rank holds 1/N of them, so a model that
    # does not fit one device trains; checkpoints are gathered into the one-device form.
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate", exclude_if=lambda value: value == "replicate"
    )


class Phase(_Strict):
    name: Name
    objective: Objective
    data: list[DataSource] = Field(min_length=1)
    sequence_length: PositiveInt
    microbatch_size: PositiveInt
    grad_accum: PositiveInt = 1
    steps: PositiveInt
    schedule: Schedule = Schedule()
    # Multiplies both optimizers' learning rates for this phase.
    lr_scale: float = Field(1.0, gt=0)
    # When set, the phase does not start unless inspecting its data meets these limits.
    inspection: InspectionGate | None = None
    # "replay" only for a continued_pretrain phase (see Role). Left out of the normalised form
    # (and so of the signature) at its default: workflows written before it keep theirs.
    role: Role = Field("train", exclude_if=lambda value: value == "train")
    # "reset": fresh Muon and AdamW state at the phase's first step; "carry": both optimizers'
    # state (momentum, moments, AdamW's step count) goes on from the previous phase's final
    # checkpoint, matched by parameter name. The learning-rate schedule and its warm-up are
    # the phase's own either way. Left out of the normalised form (and so of the signature)
    # at its default: workflows written before the field keep their signature.
    optimizer_state: Literal["reset", "carry"] = Field(
        "reset", exclude_if=lambda value: value == "reset"
    )
    # None: the workflow's `resources`. Never signed (Workflow.signed).
    resources: Resources | None = Field(None, exclude_if=lambda value: value is None)

    def sources(self) -> list[SourceGeometry]:
        """Each data source with its defaults resolved from the phase."""
        out = []
        for source in self.data:
            name = source.name or stem(source.path)
            out.append(
                SourceGeometry(
                    name=name,
                    path=source.path,
                    weight=source.weight,
                    objective=source.objective or self.objective,
                    sequence_length=source.sequence_length or self.sequence_length,
                    microbatch_size=source.microbatch_size or self.microbatch_size,
                )
            )
        return out

    @property
    def microbatch_tokens(self) -> int:
        return self.sequence_length * self.microbatch_size

    @property
    def tokens_per_step(self) -> int:
        return self.microbatch_tokens * self.grad_accum


def stem(path: str) -> str:
    """`/data/pretrain.train.jsonl.zst` -> `pretrain`: a source's default name."""
    name = PurePath(path).name.split(".", 1)[0]
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64] or "data"


class SourceGeometry(BaseModel):
    name: str
    path: str
    weight: float
    objective: Objective
    sequence_length: int
    microbatch_size: int


class Workflow(_Strict):
    name: Name
    model: ModelSpec
    tokenizer: UserPath
    seed: int = Field(0, ge=0, le=2**63 - 1)
    microbatch_tokens: PositiveInt
    optimizer: OptimizerSpec = OptimizerSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    evals: list[EvalSpec] = []
    phases: list[Phase] = Field(min_length=1)
    # Every phase's resources unless it gives its own. Never signed (Workflow.signed).
    resources: Resources = Field(Resources(), exclude_if=lambda value: value == Resources())

    @field_validator("phases")
    @classmethod
    def _steps_fit_a_run(cls, phases: list[Phase]) -> list[Phase]:
        # A run counts its steps globally (run.total_steps, checkpoint steps) in 32-bit columns.
        total = sum(p.steps for p in phases)
        if total > MAX_COUNT:
            raise PydanticCustomError(
                "total_steps",
                "the phases' steps add up to {total}, more than {most}, the most one run can "
                "count; split the run or take fewer steps",
                {"total": total, "most": MAX_COUNT},
            )
        return phases

    def data_paths(self) -> list[str]:
        """Every data file the workflow reads, in document order, without repeats."""
        paths = [s.path for p in self.phases for s in p.data] + [e.data for e in self.evals]
        return list(dict.fromkeys(paths))

    def phase_offsets(self) -> list[int]:
        """Global step at which each phase starts (phase i covers offsets[i] + 1 ...)."""
        offsets, total = [], 0
        for phase in self.phases:
            offsets.append(total)
            total += phase.steps
        return offsets

    def phase_devices(self, index: int) -> int:
        """The torch.distributed ranks phase `index` runs on, as the workflow asks."""
        return self.phase_resources(index).devices

    def phase_resources(self, index: int) -> Resources:
        return self.phases[index].resources or self.resources

    def eval_sequence_length(self, spec: EvalSpec) -> int:
        """The sequence_length an eval task is computed at, the same at every step."""
        if spec.sequence_length is not None:
            return spec.sequence_length
        return max(s.sequence_length for p in self.phases for s in p.sources())

    def normalized(self) -> dict[str, Any]:
        """Canonical JSON-able form: defaults filled in, used for storage and the signature.
        An eval set's name is left out where it is its default (the task): a document that
        gives it and one that does not mean the same, and runs signed before eval sets had
        names keep their signatures."""
        out = self.model_dump(mode="json")
        for spec in out["evals"]:
            if spec["name"] == spec["task"]:
                del spec["name"]
        return out

    def signed(self) -> dict[str, Any]:
        """The normalised form the run's signature covers: without `resources`, which say
        where the run trains (how many devices), not what it trains."""
        return without_resources(self.normalized())


def without_resources(normalized: dict[str, Any]) -> dict[str, Any]:
    """A normalised workflow without its and its phases' `resources`; the form given is not
    modified."""
    out = {k: v for k, v in normalized.items() if k != "resources"}
    phases = out.get("phases")
    if isinstance(phases, list):
        out["phases"] = [
            {k: v for k, v in p.items() if k != "resources"} if isinstance(p, dict) else p
            for p in phases
        ]
    return out


def defaults_written_out(normalized: dict[str, Any]) -> dict[str, Any]:
    """A stored normalised form with the defaults `Workflow.normalized` leaves out written back
    (a phase's role and optimizer state, an eval set's name), so that two forms compare field
    by field: a difference reads "reset" against "carry", not null against "carry"."""
    out = copy.deepcopy(normalized)
    left_out = {
        name: info.default
        for name, info in Phase.model_fields.items()
        if info.exclude_if is not None
    }
    for phase in out.get("phases") or []:
        if isinstance(phase, dict):
            for name, default in left_out.items():
                phase.setdefault(name, default)
    for spec in out.get("evals") or []:
        if isinstance(spec, dict) and "task" in spec:
            spec.setdefault("name", spec["task"])
    return out
