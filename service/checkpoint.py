"""Registered checkpoints of a run (the files themselves live in the artifact store)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Checkpoint


def list_checkpoints(*, session: Session, run_id: str) -> list[Checkpoint]:
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)
        )
    )


def latest_checkpoint(*, session: Session, run_id: str) -> Checkpoint | None:
    """The newest registered checkpoint, by global step: where any new attempt starts from."""
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    ).one_or_none()
