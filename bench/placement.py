"""Placement latency and the phase hand-off.

- **decision**: `service.workers.scheduler.decide` alone over an in-memory snapshot of
  `--queued` queued attempts (mixed priorities, 3 owners, one with a quota) and `--workers`
  live workers, all busy (the steady state of a full fleet: nothing placeable, every attempt's
  reason computed, the lowest running ones considered for preemption; equal priorities keep
  preemption out).
- **pass, nothing to place**: one `service.workers.placement.place` on Postgres over the same
  data: the lock row, the snapshot's queries, the decision, the commit (reasons are written on
  the first pass only, so later passes write nothing else).
- **pass that places**: one worker freed (its attempt marked succeeded) before each pass, and
  a new queued attempt added, so the queue stays at `--queued`: the pass writes the member row,
  the outbox row and the reasons that changed. What a phase's hand-off waits for in the service.
- **hand-off** (`--handoff`): a real `trainctl serve` and one `trainctl worker` (Postgres,
  Redis) run a workflow of `--phases` tiny phases; for each boundary, from the previous
  attempt's `finished_at` (the finish committed) to the next one's `claimed_at` (the worker
  took the message from its own queue and claimed): the placement pass, the outbox send,
  Celery's delivery and the claim, without contention.

    PYTHONPATH=. .venv/bin/python bench/placement.py [--queued 100] [--workers 16]
        [--rounds 30] [--handoff] [--phases 4]

Uses a fresh database on TEST_POSTGRES_URL's server (default
postgresql://postgres@127.0.0.1:5432/test), dropped at exit. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from sqlalchemy import update  # noqa: E402

from service.db import make_engine, make_session_factory, upgrade_database  # noqa: E402
from service.models import (  # noqa: E402
    ApiToken,
    Attempt,
    AttemptMember,
    Run,
    Worker,
    Workflow,
)
from service.workers.placement import place, snapshot  # noqa: E402
from service.workers.scheduler import decide  # noqa: E402

ADMIN_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
QUEUE = "bench"


@contextmanager
def fresh_database() -> Iterator[str]:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    base = ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f} ms (p90 {quantile(values, 0.9) * 1000:.2f})"


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def seed(sessions: Any, *, queued: int, workers: int) -> list[str]:
    """Workflow, owners, `workers` live workers each running one attempt, `queued` queued
    attempts; returns the running attempts' ids."""
    now = datetime.now(UTC)
    with sessions() as session:
        session.add(Workflow(id="w" * 64, name="w", spec={}))
        for owner, cap in (("alice", 4), ("bob", None), ("carol", None)):
            session.add(
                ApiToken(id=owner, name=owner, role="user", token_sha256=owner * 8, max_devices=cap)
            )
        session.flush()
        running = []
        for k in range(workers):
            key = f"w{k:03d}"
            session.add(
                Worker(
                    hostname="h",
                    pid=k + 1,
                    version="v",
                    queue=QUEUE,
                    key=key,
                    devices=1,
                    last_seen_at=now,
                )
            )
            attempt_id = add_attempt(session, k, status="running", priority=0, at=now)
            session.add(
                AttemptMember(attempt_id=attempt_id, member=0, worker_id=key, placed_at=now)
            )
            running.append(attempt_id)
        for k in range(queued):
            add_attempt(
                session,
                workers + k,
                status="queued",
                priority=0,
                at=now + timedelta(milliseconds=k),
            )
        session.commit()
    return running


_OWNERS = ("alice", "bob", "carol")


def add_attempt(session: Any, n: int, *, status: str, priority: int, at: datetime) -> str:
    run_id, attempt_id = f"run_{n:06d}", f"att_{n:06d}"
    session.add(
        Run(
            id=run_id,
            workflow_id="w" * 64,
            name=f"r{n}",
            status="queued",
            signature="s" * 64,
            signature_components={},
            plan={},
            total_steps=10,
            max_restarts=0,
            max_preemptions=0,
            owner_id=_OWNERS[n % 3],
            priority=priority,
        )
    )
    session.flush()
    session.add(
        Attempt(id=attempt_id, run_id=run_id, number=1, phase_index=0, status=status, queued_at=at)
    )
    session.flush()
    return attempt_id


def bench_placement(url: str, *, queued: int, workers: int, rounds: int) -> dict[str, str]:
    upgrade_database(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    running = seed(sessions, queued=queued, workers=workers)
    lease = 3600.0
    with sessions() as session:
        state = snapshot(session=session, now=datetime.now(UTC), lease_seconds=lease, queue=QUEUE)
    decisions = []
    for _ in range(rounds):
        start = time.perf_counter()
        decide(
            queued=state.queued, active=state.active, machines=state.machines, quotas=state.quotas
        )
        decisions.append(time.perf_counter() - start)
    place(session_factory=sessions, lease_seconds=lease, queue=QUEUE)  # writes the reasons
    idle = []
    for _ in range(rounds):
        start = time.perf_counter()
        decision = place(session_factory=sessions, lease_seconds=lease, queue=QUEUE)
        idle.append(time.perf_counter() - start)
        assert not decision.placements
    placing = []
    next_n = workers + queued
    for k in range(rounds):
        with sessions() as session:
            session.execute(
                update(Attempt)
                .where(Attempt.id == running[k % len(running)])
                .values(status="succeeded")
            )
            add_attempt(session, next_n, status="queued", priority=0, at=datetime.now(UTC))
            next_n += 1
            session.commit()
        start = time.perf_counter()
        decision = place(session_factory=sessions, lease_seconds=lease, queue=QUEUE)
        placing.append(time.perf_counter() - start)
        assert len(decision.placements) == 1, decision.placements
        running[k % len(running)] = decision.placements[0].attempt_id
        with sessions() as session:  # claimed: running now
            session.execute(
                update(Attempt)
                .where(Attempt.id == running[k % len(running)])
                .values(status="running")
            )
            session.commit()
    engine.dispose()
    return {
        "decision": ms(decisions),
        "pass, nothing to place": ms(idle),
        "pass that places": ms(placing),
    }


def bench_handoff(url: str, *, phases: int) -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from exact import workflow
    from procs import Stack, processes, wait_for_run

    upgrade_database(url)
    doc = workflow("continued_pretrain", steps=4)
    (phase,) = doc["phases"]
    doc["phases"] = [{**phase, "name": f"p{i}"} for i in range(phases)]
    with tempfile.TemporaryDirectory() as tmp, processes() as procs:
        stack = Stack(Path(tmp), url, procs)
        with stack.api() as api:
            worker = stack.worker(TRAINCTL_HEARTBEAT_SECONDS="0.5")
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            run = wait_for_run(api, run_id, timeout=600, procs=[worker])
    assert run["status"] == "succeeded", run
    attempts = sorted(run["attempts"], key=lambda a: a["number"])
    gaps = [
        (
            datetime.fromisoformat(b["claimed_at"]) - datetime.fromisoformat(a["finished_at"])
        ).total_seconds()
        for a, b in itertools.pairwise(attempts)
    ]
    return {f"hand-off ({len(gaps)} boundaries)": ms(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=100)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--handoff", action="store_true")
    parser.add_argument("--phases", type=int, default=4)
    args = parser.parse_args()
    results: dict[str, str] = {}
    with fresh_database() as url:
        results |= bench_placement(
            url, queued=args.queued, workers=args.workers, rounds=args.rounds
        )
    if args.handoff:
        with fresh_database() as url:
            results |= bench_handoff(url, phases=args.phases)
    print(
        f"{platform.machine()} {os.cpu_count()} cores; {args.queued} queued attempts, "
        f"{args.workers} workers, {args.rounds} rounds; median (p90)\n"
    )
    print("| measure | time |\n|---|---:|")
    for name, value in results.items():
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
