"""The token ledger (`GET /runs/{id}/ledger`): per phase and data source, the tokens the plan
gives it against those its worker trained (contracts.ledger's series), and the run's realised
replay share against its plan's.

A read costs what it returns: each count is the last point of its cumulative series inside its
phase's steps, one seek at the end of an index range of the metrics' primary key (run, name,
step), whatever the number of steps stored.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import literal, select, union_all
from sqlalchemy.orm import Session

from contracts.api import LedgerPhase, LedgerPublic, LedgerSource
from contracts.ledger import ledger_series
from contracts.workflow import PhasePlan, Plan
from service.models import MetricPoint, Run

# Lookups per statement: SQLite takes at most 500 terms of a compound SELECT.
_LOOKUPS_PER_STATEMENT = 200

Lookup = tuple[str, int, int]  # a series' name, and the first and last step to look in


def last_points(*, session: Session, run_id: str, lookups: Sequence[Lookup]) -> list[float | None]:
    """The value of the last point of each series in its steps (None: none there), in the
    order of `lookups`; one index seek each, in statements of up to 200 of them."""
    found: list[float | None] = []
    for at in range(0, len(lookups), _LOOKUPS_PER_STATEMENT):
        chunk = lookups[at : at + _LOOKUPS_PER_STATEMENT]
        parts = [
            select(
                literal(k).label("k"),
                select(MetricPoint.value)
                .where(
                    MetricPoint.run_id == run_id,
                    MetricPoint.name == name,
                    MetricPoint.step >= first,
                    MetricPoint.step <= last,
                )
                .order_by(MetricPoint.step.desc())
                .limit(1)
                .scalar_subquery()
                .label("value"),
            )
            for k, (name, first, last) in enumerate(chunk)
        ]
        statement = parts[0] if len(parts) == 1 else union_all(*parts)
        values: dict[int, float | None] = {k: v for k, v in session.execute(statement)}
        found += [values.get(k) for k in range(len(chunk))]
    return found


def token_ledger(*, session: Session, run: Run) -> LedgerPublic:
    plan = Plan.model_validate(run.plan)
    lookups = [
        (name, phase.first_step, phase.last_step)
        for phase in plan.phases
        for source in phase.sources
        for name in ledger_series(source.name)
    ]
    values = iter(last_points(session=session, run_id=run.id, lookups=lookups))
    phases = []
    for index, phase in enumerate(plan.phases):
        begun = run.step >= phase.first_step
        counts = [(next(values), next(values), next(values)) for _ in phase.sources]
        phases.append(_phase(index, phase, counts, begun=begun))
    return _totals(run, plan, phases)


def _count(value: float | None, begun: bool) -> int | None:
    """A count read back: none before the phase's first step (0), unknown when the phase has
    begun and nothing was reported (None)."""
    if not begun:
        return 0
    return None if value is None else round(value)


def _phase(
    index: int,
    phase: PhasePlan,
    counts: list[tuple[float | None, float | None, float | None]],
    *,
    begun: bool,
) -> LedgerPhase:
    trained = [_count(tokens, begun) for tokens, _, _ in counts]
    total = None if None in trained else sum(t for t in trained if t is not None)
    replay = sum(t or 0 for t, s in zip(trained, phase.sources, strict=True) if phase.replays(s))
    sources = [
        LedgerSource(
            name=source.name,
            objective=source.objective,
            replay=phase.replays(source),
            planned_tokens=source.compute_tokens,
            planned_share=source.token_share,
            trained_tokens=tokens,
            trained_share=tokens / total if tokens is not None and total else None,
            target_tokens=_count(targets, begun),
            epochs=(0.0 if not begun else epochs),
        )
        for source, tokens, (_, targets, epochs) in zip(phase.sources, trained, counts, strict=True)
    ]
    return LedgerPhase(
        index=index,
        name=phase.name,
        objective=phase.objective,
        role=phase.role,
        first_step=phase.first_step,
        last_step=phase.last_step,
        planned_tokens=phase.compute_tokens,
        trained_tokens=total,
        planned_replay_share=phase.replay_token_share,
        replay_share=replay / total if total else None,
        sources=sources,
    )


def _totals(run: Run, plan: Plan, phases: list[LedgerPhase]) -> LedgerPublic:
    """The run's counts: unknown (None) while any phase begun has none."""
    known = all(p.trained_tokens is not None for p in phases)
    trained = sum(p.trained_tokens or 0 for p in phases) if known else None
    replay = (
        sum(s.trained_tokens or 0 for p in phases for s in p.sources if s.replay) if known else None
    )
    post = sum(
        p.trained_tokens or 0
        for p, planned in zip(phases, plan.phases, strict=True)
        if planned.post_training
    )
    return LedgerPublic(
        run_id=run.id,
        step=run.step,
        planned_tokens=plan.compute_tokens,
        trained_tokens=trained,
        planned_replay_tokens=plan.replay_tokens,
        replay_tokens=replay,
        planned_replay_share=plan.replay_token_share,
        replay_share=replay / trained if replay is not None and trained else None,
        planned_post_training_replay_share=plan.post_training_replay_share,
        post_training_replay_share=replay / post if replay is not None and post else None,
        phases=phases,
    )
