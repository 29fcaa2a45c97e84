"""The registry of a run's checkpoints (the files themselves live in the artifact store).

A checkpoint's status follows the disk: `usable` from its registration until its worker reports
it `deleted` (retention) or `quarantined` (it failed verification and was renamed aside), with
the reason. Only usable checkpoints are listed by default, handed out as `resume_from`, or taken
as another run's initial checkpoint. A step registered again (a resumed attempt writing it anew)
is usable again.

Pins: a checkpoint that another run names as its initial checkpoint (`{"run", "step"}`, or a
path mapped to it, kept in the run's signature components) or as its pretrained model (by its
registered path, in the run's workflow) is pinned while that run may still load it: until it
succeeded, and as long as it has no usable checkpoint of its own (a failed or cancelled run
may be resumed; a resume starts from the run's own latest checkpoint when it has one, and only
otherwise from the initial checkpoint, which the worker then hashes again). The answer to each
registration carries the run's pinned steps and worker retention keeps them; a report that a
pinned checkpoint was deleted is refused (409 `checkpoint_pinned`, service.workers.report
.remove_checkpoint), so the registry never says "deleted" of what a run still needs.

Best checkpoints: a workflow's `checkpoint.keep_best` names eval sets whose best checkpoint is
kept while the run exists: of the steps with a usable checkpoint, the one whose evaluation of
the set has the lowest cross-entropy (the earliest on ties; `best_steps`). Those steps are
pinned too (`kept_best`): listed in every registration's answer, and a report of their deletion
refused alike. Evaluations at steps without a checkpoint are never a best checkpoint; the
checkpoints' answer says when a set's best evaluation is such a step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Final, Literal

from sqlalchemy import func, select, union
from sqlalchemy.orm import Session, aliased

from contracts.api import BestCheckpoint
from service.lifecycle import RunStatus
from service.models import Checkpoint, EvalResult, Run, Workflow

USABLE: Final = "usable"
# The directory a checkpoint of step N lies in, in its run's folder (service.workers.report
# .checkpoint_path_of): `checkpoints/step-NNNNNNNN`.
CHECKPOINTS_DIR: Final = "checkpoints"
# What GET /runs/{id}/checkpoints lists: one status, or every checkpoint ever registered.
CheckpointFilter = Literal["usable", "deleted", "quarantined", "all"]


def list_checkpoints(
    *, session: Session, run_id: str, status: CheckpointFilter = USABLE
) -> list[Checkpoint]:
    """The run's checkpoints of `status` (default: usable ones), oldest first."""
    query = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if status != "all":
        query = query.where(Checkpoint.status == status)
    return list(session.scalars(query.order_by(Checkpoint.step)))


def usable_checkpoint(
    *, session: Session, run_id: str, step: int, lock: bool = False
) -> Checkpoint | None:
    """The run's usable checkpoint at `step`, if any. With `lock` (Postgres), its row stays
    locked until commit: a run created from it and a concurrent report that it was deleted
    serialise, and the report then sees the new run's pin."""
    query = select(Checkpoint).where(
        Checkpoint.run_id == run_id, Checkpoint.step == step, Checkpoint.status == USABLE
    )
    return session.scalars(query.with_for_update() if lock else query).one_or_none()


def pins(*, session: Session, run_id: str) -> dict[int, list[str]]:
    """Step -> the runs that may still load the run's checkpoint at that step as their initial
    checkpoint or pretrained model: not succeeded, with no usable checkpoint of their own."""
    initial = Run.signature_components
    own = aliased(Checkpoint)
    has_own = select(own.id).where(own.run_id == Run.id, own.status == USABLE).exists()
    may_load = (Run.status != RunStatus.SUCCEEDED, ~has_own)
    named = select(
        initial[("initial_checkpoint", "step")].as_integer().label("step"), Run.id
    ).where(initial[("initial_checkpoint", "run")].as_string() == run_id, *may_load)
    # A pretrained directory in the artifact store is stored as its checkpoint's registered
    # path (service.runs.workflow.parse_workflow), so the path finds the step.
    source = aliased(Checkpoint)
    pretrained = (
        select(source.step.label("step"), Run.id)
        .join(Workflow, Workflow.id == Run.workflow_id)
        .join(source, source.path == Workflow.spec[("model", "pretrained")].as_string())
        .where(source.run_id == run_id, *may_load)
    )
    both = union(named, pretrained).subquery()
    pinned: dict[int, list[str]] = defaultdict(list)
    for step, pinning_run in session.execute(select(both).order_by(both.c.id)):
        pinned[step].append(pinning_run)
    return dict(pinned)


def best_steps(
    *, session: Session, run_id: str, sets: Sequence[str] | None = None, checkpointed: bool
) -> dict[str, tuple[int, float]]:
    """Per eval set of the run (those of `sets` only, when given) with a scored evaluation:
    (step, cross-entropy) of its lowest cross-entropy, the earliest step on ties; with
    `checkpointed`, among the steps that have a usable checkpoint only (its best checkpoint).
    Reads the run's evaluations of those sets, which are few."""
    rank = func.row_number().over(
        partition_by=EvalResult.name, order_by=(EvalResult.cross_entropy, EvalResult.step)
    )
    query = select(
        EvalResult.name, EvalResult.step, EvalResult.cross_entropy, rank.label("rank")
    ).where(EvalResult.run_id == run_id, EvalResult.cross_entropy.is_not(None))
    if sets is not None:
        query = query.where(EvalResult.name.in_(sets))
    if checkpointed:
        query = query.join(
            Checkpoint,
            (Checkpoint.run_id == EvalResult.run_id)
            & (Checkpoint.step == EvalResult.step)
            & (Checkpoint.status == USABLE),
        )
    ranked = query.subquery()
    rows = session.execute(
        select(ranked.c.name, ranked.c.step, ranked.c.cross_entropy).where(ranked.c.rank == 1)
    )
    return {name: (step, cross_entropy) for name, step, cross_entropy in rows}


def keep_best_sets(*, session: Session, run_id: str) -> list[str]:
    """The eval sets the run's workflow keeps the best checkpoint of (`checkpoint.keep_best`)."""
    spec = session.scalar(
        select(Workflow.spec).join(Run, Run.workflow_id == Workflow.id).where(Run.id == run_id)
    )
    checkpoint = (spec or {}).get("checkpoint") or {}
    return list(checkpoint.get("keep_best") or [])


def kept_best(*, session: Session, run_id: str) -> dict[int, list[str]]:
    """Step -> the eval sets of `checkpoint.keep_best` whose best checkpoint it is."""
    sets = keep_best_sets(session=session, run_id=run_id)
    if not sets:
        return {}
    kept: dict[int, list[str]] = defaultdict(list)
    found = best_steps(session=session, run_id=run_id, sets=sets, checkpointed=True)
    for name, (step, _) in sorted(found.items()):
        kept[step].append(name)
    return dict(kept)


def pinned_steps(*, session: Session, run_id: str) -> list[int]:
    """The steps of the run's checkpoints that retention must keep, ascending: those other
    runs may still start from, and the best of the sets the run keeps the best of."""
    return sorted(
        {*pins(session=session, run_id=run_id), *kept_best(session=session, run_id=run_id)}
    )


def best_checkpoints(*, session: Session, run_id: str) -> list[BestCheckpoint]:
    """Per eval set of the run with a scored evaluation, by name: its best checkpoint, beside
    its best evaluation, and a note when that evaluation's step has no usable checkpoint."""
    best = best_steps(session=session, run_id=run_id, checkpointed=False)
    checkpointed = best_steps(session=session, run_id=run_id, checkpointed=True)
    kept = set(keep_best_sets(session=session, run_id=run_id))
    out = []
    for name, (step, cross_entropy) in sorted(best.items()):
        chosen = checkpointed.get(name)
        note = None
        if chosen is None or chosen[0] != step:
            instead = (
                f"the best checkpoint is step {chosen[0]}'s (cross-entropy {chosen[1]:.4f})"
                if chosen is not None
                else "no step of it has a usable checkpoint"
            )
            note = (
                f"its best evaluation, step {step} (cross-entropy {cross_entropy:.4f}), has "
                f"no usable checkpoint; {instead}"
            )
        out.append(
            BestCheckpoint(
                name=name,
                kept=name in kept,
                step=None if chosen is None else chosen[0],
                cross_entropy=None if chosen is None else chosen[1],
                best_eval_step=step,
                best_eval_cross_entropy=cross_entropy,
                note=note,
            )
        )
    return out
