"""Another run's checkpoint as a source.

A run's initial checkpoint, its pretrained model and an evaluation may name another run's
checkpoint, as `{"run", "step"}` or by a path into that run's folder of the artifact store.
Either way it is that run's registered, usable checkpoint at that step, and only of a run the
caller may see: the path is mapped to the reference first, and both take one road from there.
An initial checkpoint may also be `{"run", "best": SET}`: that run's best checkpoint of the
eval set, resolved to its step on the same road.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contracts.api import CheckpointOf
from contracts.paths import DataRoots, PathUse
from service.checkpoints.registry import (
    CHECKPOINTS_DIR,
    USABLE,
    best_steps,
    list_checkpoints,
    usable_checkpoint,
)
from service.errors import ApiError
from service.models import Checkpoint, EvalResult, Run

_STEP_DIR = re.compile(r"step-(\d{8,})")


def refusal(code: str, field: str, message: str, facts: dict[str, Any]) -> ApiError:
    """422 `code` about the checkpoint `field` names: `invalid_initial_checkpoint` carries the
    facts as its details; a request-wide code (`invalid_workflow`, `invalid_request`) a list of
    problems, this one at its field with the facts as its `checkpoint`."""
    if code == "invalid_initial_checkpoint":
        return ApiError(422, code, f"{field}: {message}", facts)
    problem = {"path": field, "message": message, "checkpoint": facts}
    return ApiError(422, code, f"{field}: {message}", [problem])


def source_run(
    *, session: Session, run_id: str, owner_id: str | None, field: str, path: str | None = None
) -> Run:
    """The run whose checkpoint `field` names; 404 `run_not_found` when it does not exist or,
    with `owner_id` (the caller's scope, service.access.owner_filter), it is another owner's:
    one answer for both, naming only what the request gave."""
    run = session.get(Run, run_id)
    if run is None or (owner_id is not None and run.owner_id != owner_id):
        what = f"run {run_id!r} does not exist"
        if path is not None:
            what = f"{path} lies in the folder of run {run_id!r}, which does not exist"
        raise ApiError(
            404,
            "run_not_found",
            f"{field}: {what}; list runs with GET /runs",
            {"field": field, "run": run_id, **({} if path is None else {"path": path})},
        )
    return run


def check_run_folders(
    *,
    session: Session,
    fields: Iterable[tuple[str, str | None, PathUse]],
    roots: DataRoots,
    owner_id: str | None,
) -> None:
    """Every path of `fields` (JSON path, absolute path, use) that resolves into a run's folder
    of the artifact store, whatever it names (a checkpoint's tokenizer taken as a tokenizer, a
    file copied there as data), is of that run: 404 as source_run when the caller may not see
    it. Operators whose data roots hold the artifact store would otherwise open every run's
    files to every user."""
    for field, path, _ in fields:
        if path is not None and (found := roots.in_runs(path)) is not None:
            source_run(session=session, run_id=found[0], owner_id=owner_id, field=field, path=path)


def source_checkpoint(
    *,
    session: Session,
    given: CheckpointOf,
    owner_id: str | None,
    field: str,
    code: str,
    path: str | None = None,
) -> Checkpoint:
    """Run `given.run`'s usable checkpoint at `given.step` (or, for `given.best`, at the step
    of that eval set's best checkpoint: best_step), its row locked until the caller commits (a
    run created from it then pins it before a concurrent deletion report is judged). 404 as
    source_run; 422 `code` naming the run and the steps it has when it has none usable at that
    step (and why, when it was deleted or quarantined)."""
    source_run(session=session, run_id=given.run, owner_id=owner_id, field=field, path=path)
    step = given.step
    if step is None:
        assert given.best is not None  # CheckpointOf: one of the two
        step = best_step(session=session, run_id=given.run, name=given.best, field=field, code=code)
    chosen = usable_checkpoint(session=session, run_id=given.run, step=step, lock=True)
    if chosen is not None:
        return chosen
    every = list_checkpoints(session=session, run_id=given.run, status="all")
    steps = [c.step for c in every if c.status == USABLE]
    available = ", ".join(str(s) for s in steps) or "none yet"
    facts: dict[str, Any] = {"run": given.run, "step": step, "available_steps": steps}
    removed = next((c for c in every if c.step == step), None)
    what = f"has no registered checkpoint at step {step}"
    if removed is not None:
        what = f"no longer has its checkpoint at step {step}: {removed.status} ({removed.reason})"
        facts.update(status=removed.status, reason=removed.reason)
    raise refusal(
        code,
        field,
        f"run {given.run!r} {what}; its usable checkpoints are at steps: {available} "
        f"(GET /runs/{given.run}/checkpoints)",
        facts,
    )


def best_step(*, session: Session, run_id: str, name: str, field: str, code: str) -> int:
    """The step of run `run_id`'s best checkpoint of eval set `name`
    (service.checkpoints.registry.best_steps). 422 `code` naming the set and what is missing:
    the run has no scored evaluation of it (naming the sets it has), or none of the steps it
    was evaluated at has a usable checkpoint (naming both)."""
    found = best_steps(session=session, run_id=run_id, sets=[name], checkpointed=True)
    if name in found:
        return found[name][0]
    facts: dict[str, Any] = {"run": run_id, "best": name}
    evaluated = session.scalars(
        select(EvalResult.step)
        .where(
            EvalResult.run_id == run_id,
            EvalResult.name == name,
            EvalResult.cross_entropy.is_not(None),
        )
        .order_by(EvalResult.step)
    ).all()
    if not evaluated:
        sets = sorted(best_steps(session=session, run_id=run_id, checkpointed=False))
        facts["evaluated_sets"] = sets
        what = (
            f"has no evaluation of eval set {name!r} to take the best of; the sets it was "
            f"evaluated on: {', '.join(repr(s) for s in sets) or 'none yet'}"
        )
    else:
        steps = [c.step for c in list_checkpoints(session=session, run_id=run_id)]
        facts.update(evaluated_steps=list(evaluated), available_steps=steps)
        what = (
            f"evaluated eval set {name!r} at steps {', '.join(map(str, evaluated))}, none of "
            f"which has a usable checkpoint (its usable checkpoints are at steps: "
            f'{", ".join(map(str, steps)) or "none yet"}); name one with "step", or set '
            "checkpoint.keep_best in its workflow so that the best one is kept"
        )
    raise refusal(code, field, f"run {run_id!r} {what}", facts)


def stored_checkpoint(
    *,
    session: Session,
    path: str,
    roots: DataRoots,
    owner_id: str | None,
    field: str,
    code: str,
) -> Checkpoint | None:
    """The registered checkpoint a path (absolute) names when it resolves into a run's folder
    of the artifact store; None when it lies elsewhere. Its run is checked first (404 as
    source_run); a path there that is no checkpoint directory of the run
    (`checkpoints/step-NNNNNNNN`) is 422 `code`, and one that is goes on as source_checkpoint."""
    found = roots.in_runs(path)
    if found is None:
        return None
    run_id, below = found
    source_run(session=session, run_id=run_id, owner_id=owner_id, field=field, path=path)
    match = _STEP_DIR.fullmatch(below[1]) if len(below) == 2 else None
    if below[:1] != (CHECKPOINTS_DIR,) or match is None or below[1] != f"step-{int(match[1]):08d}":
        steps = [c.step for c in list_checkpoints(session=session, run_id=run_id)]
        raise refusal(
            code,
            field,
            f"{path} lies in run {run_id!r}'s folder but is not one of its checkpoint "
            f"directories; name one (<artifact root>/runs/{run_id}/{CHECKPOINTS_DIR}/step-N), "
            f'or give {{"run": {run_id!r}, "step": N}}; its usable checkpoints are at '
            f"steps: {', '.join(map(str, steps)) or 'none yet'}",
            {"path": path, "run": run_id, "available_steps": steps},
        )
    given = CheckpointOf(run=run_id, step=int(match[1]))
    return source_checkpoint(
        session=session, given=given, owner_id=owner_id, field=field, code=code, path=path
    )
