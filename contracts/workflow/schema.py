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


def name_optional_in_schema(schema: dict[str, Any]) -> None:
    """The JSON Schema of a model whose `name` defaults to its task (name_defaults_to_task):
    `name` is not required, as the model does not require it (the schema would otherwise
    refuse a document the model takes)."""
    schema["required"] = [field for field in schema.get("required", []) if field != "name"]
    schema["properties"]["name"].setdefault("description", "default: the task")


class _Strict(BaseModel):
    # Python's JSON parser accepts Infinity and NaN; a learning rate of either only fails later,
    # on a GPU, so they are refused here.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """Either a transformers config (llama-style; `model_type` defaults to "llama") or a local
    directory holding a pretrained model (`save_pretrained` output)."""

    config: dict[str, Any] | None = Field(
        None,
        description="A transformers model config (its `config.json` keys); `model_type` "
        'defaults to "llama". Give this or `pretrained`.',
    )
    pretrained: UserPath | None = Field(
        None,
        description="A local directory holding a pretrained model (`save_pretrained` output), "
        "relative to the data root or inside the data roots. Give this or `config`.",
    )


class OptimizerSpec(_Strict):
    """Muon for the 2-D hidden weights, AdamW for everything else (embeddings, head, norms)."""

    muon_lr: float = Field(0.02, gt=0, description="Muon's learning rate (2-D hidden weights).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum.")
    muon_weight_decay: float = Field(0.0, ge=0, description="Muon's decoupled weight decay.")
    adamw_lr: float = Field(
        3e-3, gt=0, description="AdamW's learning rate (embeddings, head, norms, biases)."
    )
    adamw_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2).")
    adamw_weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the global gradient norm to this; null: no clipping."
    )


class CheckpointSpec(_Strict):
    """When checkpoints are saved and which are kept. A phase's last step always saves one."""

    every_steps: PositiveInt = Field(100, description="Save a checkpoint every this many steps.")
    keep_last: int = Field(
        2,
        ge=2,
        le=MAX_COUNT,
        description="Keep the newest this many checkpoints; at least two, so that a corrupt "
        "newest checkpoint always has a predecessor to fall back to.",
    )
    # Left out of the normalised form (and so of the signature) when empty: workflows written
    # before it keep their signature.
    keep_best: list[Name] = Field(
        [],
        exclude_if=lambda value: not value,
        description="Eval sets (by name) whose best checkpoint is kept beside the last "
        "`keep_last`: of the steps with a checkpoint, the one whose evaluation of the set has "
        "the lowest cross-entropy.",
    )


class EvalSpec(_Strict):
    """A held-out set evaluated during the run: token-weighted, target-only cross-entropy and
    perplexity of its records, at step 0 (the baseline), every `every_steps` and at each
    phase's end."""

    model_config = ConfigDict(json_schema_extra=name_optional_in_schema)

    name: Name = Field(
        description="What the set's results are stored and answered under; by default its "
        "task. Two sets of one task (a QA mixture and a RAG set, say) need names of their own."
    )
    task: Objective = Field(description="The objective whose encoding the set is scored with.")
    data: UserPath = Field(
        description="The set's JSONL file (`.zst` too), relative to the data root or inside "
        "the data roots."
    )
    every_steps: PositiveInt = Field(100, description="Evaluate every this many steps.")
    sequence_length: PositiveInt | None = Field(
        None,
        description="One geometry for the whole run, so that every point of the set's history "
        "is comparable; null: the longest sequence_length of the workflow (phases and their "
        "sources).",
    )
    batch_size: PositiveInt = Field(
        8,
        description="Rows per forward pass; the result does not depend on it (only memory and "
        "speed do).",
    )

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

    path: UserPath = Field(
        description="The JSONL file (`.zst` too), relative to the data root or inside the data "
        "roots."
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="A share of *tokens* (of the phase's envelope tokens), relative to the "
        "other sources of the phase.",
    )
    name: (
        Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")] | None
    ) = Field(
        None,
        description="Names the source's metrics (`loss/<name>`); null: the file name without "
        "its suffixes.",
    )
    objective: Objective | None = Field(None, description="null: the phase's objective.")
    sequence_length: PositiveInt | None = Field(
        None, description="null: the phase's sequence_length."
    )
    microbatch_size: PositiveInt | None = Field(
        None, description="null: the phase's microbatch_size."
    )


class InspectionGate(_Strict):
    """Limits a phase's data must meet before its first step (checked by the worker with the
    same encoder as training; see docs/data.md). Refused records and records with no target
    tokens always stop training; these limits add what is allowed of the rest."""

    max_trimmed_share: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Most share of records whose elastic segments may be trimmed or dropped "
        "to fit.",
    )
    max_duplicate_share: float = Field(
        1.0, ge=0, le=1, description="Most share of records that repeat an earlier one exactly."
    )


class Schedule(_Strict):
    """Learning-rate multiplier over a phase: linear warmup, then either cosine decay or
    warmup-stable-decay (WSD: flat, then a linear decay over the last `decay_fraction`)."""

    kind: Literal["wsd", "cosine"] = Field("cosine", description="The shape after warmup.")
    warmup_steps: int = Field(
        0, ge=0, le=MAX_COUNT, description="Steps of linear warmup from zero."
    )
    decay_fraction: float = Field(
        0.2, ge=0, le=1, description="wsd: the share of the phase's steps the decay takes."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="The multiplier the decay ends at.")


# The most torch.distributed ranks one phase may ask of one worker (a machine of GPUs).
MAX_DEVICES = 64
# The most workers (machines) one phase may run across at once.
MAX_NODES = 64


class Resources(_Strict):
    """What one attempt of a phase runs on: `nodes` workers with `devices` ranks of
    torch.distributed each, nodes x devices ranks in all (DDP: each rank holds the whole model
    and takes its share of every step's microbatches). Not part of the run's identity: the
    same global batch is trained whatever the counts, so a run pre-empted on 8 devices may go
    on on 4 (`POST /runs/{id}/resume` `devices`). `nodes` is left out of the normalised form
    when it is 1, so workflows that do not set it keep their stored form."""

    nodes: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        exclude_if=lambda value: value == 1,
        description="Workers (machines) the phase runs across, all reserved together or not "
        "at all; their ranks join by torch.distributed's c10d rendezvous.",
    )

    devices: int = Field(
        1, ge=1, le=MAX_DEVICES, description="Ranks of torch.distributed, on one worker."
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate",
        exclude_if=lambda value: value == "replicate",
        description='"replicate": DDP, every rank holds the whole model and optimizer state. '
        '"fsdp": FSDP2 (`fully_shard`, per transformer block), each rank holds 1/N of them, '
        "so a model that does not fit one device trains; checkpoints are gathered into the "
        "one-device form.",
    )


class Phase(_Strict):
    """One stage of training: an objective, a data mixture, a geometry and a number of steps,
    trained from the previous phase's final checkpoint."""

    name: Name = Field(description="The phase's name, unique in the workflow.")
    objective: Objective = Field(
        description="What the phase trains: continued pretraining (loss on every token) or a "
        "supervised task (loss on target tokens only)."
    )
    data: list[DataSource] = Field(
        min_length=1, description="The sources of the phase's mixture, weighted by tokens."
    )
    sequence_length: PositiveInt = Field(description="Tokens per row.")
    microbatch_size: PositiveInt = Field(
        description="Rows per microbatch; sequence_length x microbatch_size must equal the "
        "workflow's microbatch_tokens."
    )
    grad_accum: PositiveInt = Field(1, description="Microbatches per optimizer step.")
    steps: PositiveInt = Field(description="Optimizer steps the phase trains.")
    schedule: Schedule = Field(Schedule(), description="The learning-rate multiplier over it.")
    lr_scale: float = Field(
        1.0, gt=0, description="Multiplies both optimizers' learning rates for this phase."
    )
    inspection: InspectionGate | None = Field(
        None,
        description="When set, the phase does not start unless inspecting its data meets "
        "these limits.",
    )
    # Left out of the normalised form (and so of the signature) at its default: workflows
    # written before it keep theirs; likewise optimizer_state.
    role: Role = Field(
        "train",
        exclude_if=lambda value: value == "train",
        description='"train": the phase trains on its data. "replay" (a continued_pretrain '
        "phase only): it returns to earlier pretraining data after post-training has begun, "
        "so that the model keeps what it learned; all of it counts as replay.",
    )
    optimizer_state: Literal["reset", "carry"] = Field(
        "reset",
        exclude_if=lambda value: value == "reset",
        description='"reset": fresh Muon and AdamW state at the phase\'s first step; "carry": '
        "both optimizers' state (momentum, moments, AdamW's step count) goes on from the "
        "previous phase's final checkpoint, matched by parameter name. The learning-rate "
        "schedule and its warm-up are the phase's own either way.",
    )
    # Never signed (Workflow.signed).
    resources: Resources | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="What the phase runs on; null: the workflow's `resources`. Not part of "
        "the run's signature.",
    )

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
    """A multi-phase training workflow: one model and tokenizer trained through its phases in
    order, evaluated on its eval sets throughout."""

    name: Name = Field(description="The workflow's name; a run's name by default.")
    model: ModelSpec = Field(description="The model to train.")
    tokenizer: UserPath = Field(
        description="A tokenizers `tokenizer.json`, relative to the data root or inside the "
        "data roots."
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        description="Seeds initialisation, data order and dropout: the same seed and inputs "
        "train the same run.",
    )
    microbatch_tokens: PositiveInt = Field(
        description="The token envelope of every microbatch (sequence_length x "
        "microbatch_size of every phase and source)."
    )
    optimizer: OptimizerSpec = Field(OptimizerSpec(), description="Both optimizers' settings.")
    checkpoint: CheckpointSpec = Field(
        CheckpointSpec(), description="When checkpoints are saved and which are kept."
    )
    evals: list[EvalSpec] = Field([], description="Held-out sets evaluated during the run.")
    phases: list[Phase] = Field(min_length=1, description="The phases, trained in order.")
    # Never signed (Workflow.signed).
    resources: Resources = Field(
        Resources(),
        exclude_if=lambda value: value == Resources(),
        description="Every phase's resources unless it gives its own. Not part of the run's "
        "signature.",
    )

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

    def phase_nodes(self, index: int) -> int:
        """The workers phase `index` runs across, as the workflow asks."""
        return self.phase_resources(index).nodes

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
