"""The workflow document: schema, validation and plan.

A workflow is one JSON document describing a multi-phase training run. `validate_workflow`
parses it and reports *every* problem at once, each as a JSON path and a sentence, so a user
fixes a document in one round trip instead of one error at a time.

Nothing here reads the disk. `path_fields` says which fields name files and what each must
be; the side that reads them resolves and checks them (runtime.path).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import PurePath
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from contracts.bounds import MAX_COUNT, MAX_NAME, NO_NUL

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

# The version of the rules that turn records into token ids and loss masks (worker/encode.py,
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
    pretrained: str | None = None


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


class EvalSpec(_Strict):
    # What the set's results are stored and answered under; by default its task. Two sets of
    # one task (a QA mixture and a RAG set, say) need names of their own.
    name: Name
    task: Objective
    data: str
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


class DataSource(_Strict):
    """One source of a phase's mixture. `objective`, `sequence_length` and `microbatch_size`
    default to the phase's: a replay source of pretraining text inside a supervised phase sets
    `objective: continued_pretrain` and the pretraining stage's geometry, which must fill the
    same token envelope (`sequence_length x microbatch_size = microbatch_tokens`)."""

    path: str
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
            name = source.name or _stem(source.path)
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


def _stem(path: str) -> str:
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
    tokenizer: str
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


# --- validation ---------------------------------------------------------------------------


class Problem(BaseModel):
    path: str
    message: str


class WorkflowInvalid(ValueError):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p.path}: {p.message}" for p in problems))


def json_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """('phases', 2, 'steps') -> 'phases[2].steps'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "$"


def _pydantic_problems(err: ValidationError, prefix: tuple[int | str, ...] = ()) -> list[Problem]:
    problems = []
    for e in err.errors():
        # Discriminated/literal errors carry the expected values; phrase them for people.
        loc = prefix + tuple(e["loc"])
        if e["type"] == "literal_error" and loc[-1] in ("objective", "task"):
            msg = f"unknown objective {e['input']!r}; expected one of: {', '.join(OBJECTIVES)}"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "is required"
        else:
            msg = e["msg"]
        problems.append(Problem(path=json_path(loc), message=msg))
    return problems


# What a field that names a file must name: a regular file, a directory, or either.
PathKind = Literal["file", "directory", "path"]


def path_fields(doc: dict[str, Any]) -> list[tuple[tuple[int | str, ...], str, PathKind]]:
    """Every string of a raw workflow document that names a file or a folder, in document
    order, as (location, value, kind): the model's pretrained directory, the tokenizer (a
    tokenizer.json or a directory), each phase's data sources and each eval set's data."""
    found: list[tuple[tuple[int | str, ...], str, PathKind]] = []

    def add(loc: tuple[int | str, ...], value: Any, kind: PathKind) -> None:
        if isinstance(value, str):
            found.append((loc, value, kind))

    model = doc.get("model")
    if isinstance(model, dict):
        add(("model", "pretrained"), model.get("pretrained"), "directory")
    add(("tokenizer",), doc.get("tokenizer"), "path")
    phases = doc.get("phases")
    for i, phase in enumerate(phases if isinstance(phases, list) else []):
        data = phase.get("data") if isinstance(phase, dict) else None
        for j, source in enumerate(data if isinstance(data, list) else []):
            if isinstance(source, dict):
                add(("phases", i, "data", j, "path"), source.get("path"), "file")
    evals = doc.get("evals")
    for k, spec in enumerate(evals if isinstance(evals, list) else []):
        if isinstance(spec, dict):
            add(("evals", k, "data"), spec.get("data"), "file")
    return found


def replace_paths(doc: dict[str, Any], fix: Callable[[str], str]) -> dict[str, Any]:
    """A copy of a raw workflow document with each of its `path_fields` replaced by
    `fix(value)`; the document given is not modified."""
    out = copy.deepcopy(doc)
    for loc, value, _ in path_fields(doc):
        parent: Any = out
        for part in loc[:-1]:
            parent = parent[part]
        parent[loc[-1]] = fix(value)
    return out


def _geometry_problems(
    where: str, seq: Any, mbs: Any, envelope: int | None, max_positions: Any
) -> list[Problem]:
    """A phase's or a source's sequence_length x microbatch_size against the token envelope and
    the model's positions (values that did not parse are reported elsewhere)."""
    problems = []
    if envelope and isinstance(seq, int) and isinstance(mbs, int) and seq * mbs != envelope:
        problems.append(
            Problem(
                path=where,
                message=(
                    f"sequence_length {seq} x microbatch_size {mbs} = {seq * mbs} tokens, "
                    f"but microbatch_tokens is {envelope}"
                ),
            )
        )
    if isinstance(max_positions, int) and isinstance(seq, int) and seq > max_positions:
        problems.append(
            Problem(
                path=f"{where}.sequence_length",
                message=f"{seq} exceeds the model's max_position_embeddings {max_positions}",
            )
        )
    return problems


def _devices_problems(i: int, raw: dict[str, Any], default: Any) -> list[Problem]:
    """A phase's grad_accum counts the microbatches of a step over all its ranks: each rank
    takes the same share, so it must divide by the phase's devices."""
    own = raw.get("resources")
    where = own if isinstance(own, dict) else default if isinstance(default, dict) else {}
    devices, accum = where.get("devices", 1), raw.get("grad_accum", 1)
    valid = isinstance(devices, int) and 1 <= devices <= MAX_DEVICES
    if not (valid and isinstance(accum, int) and accum >= 1):
        return []  # reported by the schema
    message = devices_refusal(accum, devices)
    return [Problem(path=f"phases[{i}].grad_accum", message=message)] if message else []


def devices_refusal(grad_accum: int, devices: int) -> str | None:
    """Why a phase of `grad_accum` microbatches a step cannot run on `devices` ranks, or None."""
    if grad_accum % devices == 0:
        return None
    return (
        f"{grad_accum} microbatches a step do not divide over {devices} devices: grad_accum "
        f"counts a step's microbatches over all ranks, so make it a multiple of {devices} "
        "(the global batch stays the same whatever the device count)"
    )


def _check_semantics(doc: dict[str, Any]) -> list[Problem]:
    """Cross-field checks. They run on whatever parts of the document parse, so that they are
    reported together with the structural errors."""
    problems: list[Problem] = []
    add = problems.append

    envelope = doc.get("microbatch_tokens")
    envelope = envelope if isinstance(envelope, int) and envelope > 0 else None

    model = doc.get("model")
    max_positions = None
    if isinstance(model, dict):
        has_config, has_pretrained = model.get("config") is not None, model.get("pretrained")
        if bool(has_config) == bool(has_pretrained):
            add(Problem(path="model", message='give exactly one of "config" or "pretrained"'))
        if isinstance(model.get("config"), dict):
            cfg = model["config"]
            if not isinstance(cfg.get("vocab_size"), int):
                add(Problem(path="model.config.vocab_size", message="is required (an integer)"))
            max_positions = cfg.get("max_position_embeddings")

    raw_phases = doc.get("phases")
    phases = raw_phases if isinstance(raw_phases, list) else []
    seen: dict[str, int] = {}
    for i, raw in enumerate(phases):
        if not isinstance(raw, dict):
            continue
        name = raw.get("name")
        if isinstance(name, str):
            if name in seen:
                add(
                    Problem(
                        path=f"phases[{i}].name",
                        message=f"duplicate phase name {name!r} (also phases[{seen[name]}])",
                    )
                )
            else:
                seen[name] = i
        seq, mbs = raw.get("sequence_length"), raw.get("microbatch_size")
        problems += _geometry_problems(f"phases[{i}]", seq, mbs, envelope, max_positions)
        objective = raw.get("objective")
        if raw.get("role") == "replay" and objective in SUPERVISED_OBJECTIVES:
            add(
                Problem(
                    path=f"phases[{i}].role",
                    message=(
                        f'"replay" is for a continued_pretrain phase that returns to earlier '
                        f"pretraining data, and this phase's objective is {objective}; to "
                        "replay inside it, add a data source with "
                        '"objective": "continued_pretrain"'
                    ),
                )
            )
        problems += _devices_problems(i, raw, doc.get("resources"))
        if i == 0 and raw.get("optimizer_state") == "carry":
            add(
                Problem(
                    path="phases[0].optimizer_state",
                    message=(
                        '"carry" continues the previous phase\'s optimizer state, and the '
                        'first phase has none; use "reset" (the default)'
                    ),
                )
            )
        schedule, steps = raw.get("schedule"), raw.get("steps")
        if isinstance(schedule, dict) and isinstance(steps, int):
            warmup = schedule.get("warmup_steps")
            if isinstance(warmup, int) and warmup > steps:
                add(
                    Problem(
                        path=f"phases[{i}].schedule.warmup_steps",
                        message=f"warmup of {warmup} steps is longer than the phase ({steps})",
                    )
                )
        raw_data = raw.get("data")
        data = raw_data if isinstance(raw_data, list) else []
        names: dict[str, int] = {}
        for j, source in enumerate(data):
            if not isinstance(source, dict):
                continue
            where = f"phases[{i}].data[{j}]"
            path = source.get("path")
            name = source.get("name") or (_stem(path) if isinstance(path, str) else None)
            if isinstance(name, str):
                if name in names:
                    add(
                        Problem(
                            path=f"{where}.name",
                            message=(
                                f"duplicate source name {name!r} (also data[{names[name]}]); "
                                'give each source a distinct "name"'
                            ),
                        )
                    )
                names.setdefault(name, j)
            if "sequence_length" not in source and "microbatch_size" not in source:
                continue  # the phase's geometry, checked above
            s_seq = source.get("sequence_length", seq)
            s_mbs = source.get("microbatch_size", mbs)
            problems += _geometry_problems(where, s_seq, s_mbs, envelope, max_positions)

    raw_evals = doc.get("evals")
    evals = raw_evals if isinstance(raw_evals, list) else []
    set_names: dict[str, int] = {}
    for k, ev in enumerate(evals):
        set_name = (ev.get("name") or ev.get("task")) if isinstance(ev, dict) else None
        if isinstance(set_name, str):
            if set_name in set_names:
                add(
                    Problem(
                        path=f"evals[{k}].name",
                        message=(
                            f"duplicate eval set name {set_name!r} (also "
                            f"evals[{set_names[set_name]}]); results are stored by name, so "
                            'give each set of one task a distinct "name"'
                        ),
                    )
                )
            set_names.setdefault(set_name, k)
        e_seq = ev.get("sequence_length") if isinstance(ev, dict) else None
        if isinstance(max_positions, int) and isinstance(e_seq, int) and e_seq > max_positions:
            add(
                Problem(
                    path=f"evals[{k}].sequence_length",
                    message=f"{e_seq} exceeds the model's max_position_embeddings {max_positions}",
                )
            )
    return problems


def validate_workflow(doc: Any) -> Workflow:
    """Parse and check a workflow document; raise `WorkflowInvalid` listing every problem.
    Whether its files exist is the reading side's question (runtime.path)."""
    if not isinstance(doc, dict):
        raise WorkflowInvalid([Problem(path="$", message="a workflow must be a JSON object")])
    problems: list[Problem] = []
    workflow: Workflow | None = None
    try:
        workflow = Workflow.model_validate(doc)
    except ValidationError as err:
        problems.extend(_pydantic_problems(err))
    problems.extend(_check_semantics(doc))
    if problems or workflow is None:
        raise WorkflowInvalid(problems)
    return workflow


# --- plan ---------------------------------------------------------------------------------


class SourcePlan(BaseModel):
    name: str
    path: str
    objective: Objective
    sequence_length: int
    microbatch_size: int
    weight: float
    # The planned share of the phase's envelope tokens; the realised share is a metric.
    token_share: float
    compute_tokens: int


class PhasePlan(BaseModel):
    name: str
    objective: Objective
    # Plans stored before phases had roles (runs.plan) read as "train", which they were.
    role: Role = "train"
    steps: int
    first_step: int
    last_step: int
    tokens_per_step: int
    compute_tokens: int
    token_share: float
    # Share of this phase's tokens that is replay: its continued_pretrain sources when it is
    # post-training (a supervised or a replay phase), so 1.0 for a replay phase; 0.0 for a
    # pretraining stage.
    replay_token_share: float
    sources: list[SourcePlan]

    @property
    def post_training(self) -> bool:
        """Supervised phases and replay phases; not a pretraining stage."""
        return self.objective != "continued_pretrain" or self.role == "replay"

    @property
    def replay_tokens(self) -> int:
        if not self.post_training:
            return 0
        return sum(s.compute_tokens for s in self.sources if s.objective == "continued_pretrain")


class Plan(BaseModel):
    """Totals of a run. Replay is continued_pretrain text trained in a post-training phase:
    every token of a replay phase and every token of a continued_pretrain source of a
    supervised phase (mixture replay) alike.

    - `replay_token_share` = replay_tokens / compute_tokens: the share of ALL compute tokens.
    - `post_training_tokens`: the compute tokens of the supervised phases plus the replay
      phases, that is every phase but the pretraining stages (continued_pretrain phases of
      role "train"), wherever they stand in the run.
    - `post_training_replay_share` = replay_tokens / post_training_tokens.

    For a workflow that is all post-training (the original PR's: five supervised phases and
    four interleaved replay phases from a pretrained checkpoint, 842M compute tokens, "replay
    17.1% of tokens") both shares are the same number, the PR's; with a pretraining stage in
    the run the first is smaller."""

    total_steps: int
    compute_tokens: int
    replay_tokens: int
    post_training_tokens: int
    replay_token_share: float
    post_training_replay_share: float
    phases: list[PhasePlan]

    @model_validator(mode="before")
    @classmethod
    def _fill_stored_totals(cls, data: Any) -> Any:
        # Plans stored on runs before replay phases existed carry neither count, and their
        # replay_token_share is of supervised tokens: recompute the totals from their phases,
        # which hold everything needed (all of their phases are role "train").
        if isinstance(data, dict) and "post_training_tokens" not in data and "phases" in data:
            phases = [PhasePlan.model_validate(p) for p in data["phases"]]
            return {**data, **_totals(phases, int(data["compute_tokens"]))}
        return data


def _totals(phases: list[PhasePlan], compute_tokens: int) -> dict[str, Any]:
    replay = sum(p.replay_tokens for p in phases)
    post = sum(p.compute_tokens for p in phases if p.post_training)
    return {
        "replay_tokens": replay,
        "post_training_tokens": post,
        "replay_token_share": replay / compute_tokens if compute_tokens else 0.0,
        "post_training_replay_share": replay / post if post else 0.0,
    }


def plan(workflow: Workflow) -> Plan:
    """Totals per phase. `compute_tokens` counts envelope tokens (what the GPU processes);
    `token_share` is each phase's fraction of the run's compute tokens, and each source's
    fraction of its phase's."""
    total_tokens = sum(p.steps * p.tokens_per_step for p in workflow.phases)
    phases = []
    for phase, offset in zip(workflow.phases, workflow.phase_offsets(), strict=True):
        tokens = phase.steps * phase.tokens_per_step
        weights = sum(s.weight for s in phase.data)
        sources = [
            SourcePlan(
                **s.model_dump(),
                token_share=s.weight / weights,
                compute_tokens=round(tokens * s.weight / weights),
            )
            for s in phase.sources()
        ]
        replay = 0.0
        if phase.objective != "continued_pretrain" or phase.role == "replay":
            replay = sum(s.token_share for s in sources if s.objective == "continued_pretrain")
        phases.append(
            PhasePlan(
                name=phase.name,
                objective=phase.objective,
                role=phase.role,
                steps=phase.steps,
                first_step=offset + 1,
                last_step=offset + phase.steps,
                tokens_per_step=phase.tokens_per_step,
                compute_tokens=tokens,
                token_share=tokens / total_tokens,
                replay_token_share=replay,
                sources=sources,
            )
        )
    return Plan(
        total_steps=sum(p.steps for p in workflow.phases),
        compute_tokens=total_tokens,
        **_totals(phases, total_tokens),
        phases=phases,
    )


def perplexity(cross_entropy: float) -> float:
    """exp(ce), saturating instead of raising for an untrained model's large losses."""
    return math.exp(cross_entropy) if cross_entropy < 700 else math.inf
