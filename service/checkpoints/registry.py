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
"""

from __future__ import annotations

from collections import defaultdict
from typing import Final, Literal

from sqlalchemy import select, union
from sqlalchemy.orm import Session, aliased

from service.lifecycle import RunStatus
from service.models import Checkpoint, Run, Workflow

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


def pinned_steps(*, session: Session, run_id: str) -> list[int]:
    """The steps of the run's checkpoints that retention must keep, ascending."""
    return sorted(pins(session=session, run_id=run_id))
