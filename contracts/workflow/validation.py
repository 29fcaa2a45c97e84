"""The workflow document's validation: `validate_workflow` parses a document and reports
*every* problem at once, each as a JSON path and a sentence, so a user fixes a document in one
round trip instead of one error at a time.

Nothing here reads the disk. `path_fields` says which fields name files and what each must
be; the side that reads them resolves and checks them (runtime.path).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from contracts.workflow.schema import (
    MAX_DEVICES,
    MAX_NODES,
    OBJECTIVES,
    SUPERVISED_OBJECTIVES,
    Workflow,
    stem,
)


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


def _objects(value: Any) -> list[tuple[int, dict[str, Any]]]:
    """The objects of a list in a raw document, with their indices; nothing when `value` is not
    a list (the schema reports that, and any entry that is not an object)."""
    items = value if isinstance(value, list) else []
    return [(i, item) for i, item in enumerate(items) if isinstance(item, dict)]


def _earlier(seen: dict[str, int], name: Any, index: int) -> int | None:
    """Where `name` was first seen, or None when `index` is its first use (noted in `seen`);
    a name that is not a string is the schema's to report."""
    if not isinstance(name, str):
        return None
    first = seen.setdefault(name, index)
    return None if first == index else first


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
    for i, phase in _objects(doc.get("phases")):
        for j, source in _objects(phase.get("data")):
            add(("phases", i, "data", j, "path"), source.get("path"), "file")
    for k, spec in _objects(doc.get("evals")):
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
    """A phase's grad_accum counts the microbatches of a step over all its ranks (nodes x
    devices): each rank takes the same share, so it must divide by their number."""
    own = raw.get("resources")
    where = own if isinstance(own, dict) else default if isinstance(default, dict) else {}
    devices, accum = where.get("devices", 1), raw.get("grad_accum", 1)
    nodes = where.get("nodes", 1)
    valid = isinstance(devices, int) and 1 <= devices <= MAX_DEVICES
    valid = valid and isinstance(nodes, int) and 1 <= nodes <= MAX_NODES
    if not (valid and isinstance(accum, int) and accum >= 1):
        return []  # reported by the schema
    message = devices_refusal(accum, devices, nodes)
    return [Problem(path=f"phases[{i}].grad_accum", message=message)] if message else []


def devices_refusal(grad_accum: int, devices: int, nodes: int = 1) -> str | None:
    """Why a phase of `grad_accum` microbatches a step cannot run on `nodes` workers of
    `devices` ranks each, or None."""
    ranks = devices * nodes
    if grad_accum % ranks == 0:
        return None
    where = f"{devices} devices" if nodes == 1 else f"{nodes} nodes x {devices} devices"
    return (
        f"{grad_accum} microbatches a step do not divide over {where}: grad_accum "
        f"counts a step's microbatches over all ranks, so make it a multiple of {ranks} "
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

    seen: dict[str, int] = {}
    for i, raw in _objects(doc.get("phases")):
        name = raw.get("name")
        if (first := _earlier(seen, name, i)) is not None:
            add(
                Problem(
                    path=f"phases[{i}].name",
                    message=f"duplicate phase name {name!r} (also phases[{first}])",
                )
            )
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
        names: dict[str, int] = {}
        for j, source in _objects(raw.get("data")):
            where = f"phases[{i}].data[{j}]"
            path = source.get("path")
            name = source.get("name") or (stem(path) if isinstance(path, str) else None)
            if (first := _earlier(names, name, j)) is not None:
                add(
                    Problem(
                        path=f"{where}.name",
                        message=(
                            f"duplicate source name {name!r} (also data[{first}]); "
                            'give each source a distinct "name"'
                        ),
                    )
                )
            if "sequence_length" not in source and "microbatch_size" not in source:
                continue  # the phase's geometry, checked above
            s_seq = source.get("sequence_length", seq)
            s_mbs = source.get("microbatch_size", mbs)
            problems += _geometry_problems(where, s_seq, s_mbs, envelope, max_positions)

    set_names: dict[str, int] = {}
    for k, ev in _objects(doc.get("evals")):
        set_name = ev.get("name") or ev.get("task")
        if (first := _earlier(set_names, set_name, k)) is not None:
            add(
                Problem(
                    path=f"evals[{k}].name",
                    message=(
                        f"duplicate eval set name {set_name!r} (also evals[{first}]); results "
                        'are stored by name, so give each set of one task a distinct "name"'
                    ),
                )
            )
        e_seq = ev.get("sequence_length")
        if isinstance(max_positions, int) and isinstance(e_seq, int) and e_seq > max_positions:
            add(
                Problem(
                    path=f"evals[{k}].sequence_length",
                    message=f"{e_seq} exceeds the model's max_position_embeddings {max_positions}",
                )
            )
    problems += _keep_best_problems(doc.get("checkpoint"), list(set_names))
    return problems


def _keep_best_problems(checkpoint: Any, sets: list[str]) -> list[Problem]:
    """`checkpoint.keep_best` names eval sets of the workflow, each once."""
    names = checkpoint.get("keep_best") if isinstance(checkpoint, dict) else None
    problems = []
    seen: dict[str, int] = {}
    for i, name in enumerate(names if isinstance(names, list) else []):
        where = f"checkpoint.keep_best[{i}]"
        if (first := _earlier(seen, name, i)) is not None:
            problems.append(
                Problem(path=where, message=f"{name!r} is named twice (also keep_best[{first}])")
            )
        elif isinstance(name, str) and name not in sets:
            known = ", ".join(repr(s) for s in sets) or "none"
            problems.append(
                Problem(
                    path=where,
                    message=(
                        f"{name!r} is not an eval set of this workflow (its sets, by name: "
                        f"{known}); keep_best keeps the checkpoint where a set scored best"
                    ),
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
