"""`service.errors.is_unavailable` on real Postgres errors. SQLAlchemy raises OperationalError
for a database that cannot be reached and for a statement the database cut short (a deadlock,
a statement or lock timeout) alike; only the first is unavailability, the deafness for which
the reaper grants grace (service/workers/reaper.py). Each error here is made by a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from cli.stack import free_port
from service.db import make_engine
from service.errors import is_retryable, is_unavailable

pytestmark = pytest.mark.integration


@pytest.fixture
def engine(empty_postgres_url: str) -> Iterator[Engine]:
    engine = make_engine(empty_postgres_url)
    yield engine
    engine.dispose()


@contextmanager
def raises_from_database() -> Iterator[list[DBAPIError]]:
    """Catches the DBAPIError of the block into the list it yields."""
    caught: list[DBAPIError] = []
    with pytest.raises(DBAPIError) as raised:
        yield caught
    caught.append(raised.value)


def sqlstate(err: DBAPIError) -> str | None:
    return getattr(err.orig, "sqlstate", None)


def wait_for_lock_wait(admin: Connection, pid: int) -> None:
    """Until backend `pid` waits for a lock (polled with a deadline)."""
    deadline = time.monotonic() + 30
    query = text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid")
    while admin.execute(query, {"pid": pid}).scalar() != "Lock":
        assert time.monotonic() < deadline, f"backend {pid} never waited for a lock"
        admin.rollback()


def test_a_statement_timeout_is_not_unavailability(engine: Engine) -> None:
    with engine.connect() as conn, raises_from_database() as caught:
        conn.execute(text("SET statement_timeout = 1"))
        conn.execute(text("SELECT pg_sleep(1)"))
    (err,) = caught
    assert sqlstate(err) == "57014" and isinstance(err, OperationalError)
    assert not is_unavailable(err)
    assert is_retryable(err)  # an API request answers 503 with Retry-After


def test_a_lock_timeout_is_not_unavailability(engine: Engine) -> None:
    with engine.connect() as holder, engine.connect() as waiter:
        holder.execute(text("SELECT pg_advisory_xact_lock(1)"))
        with raises_from_database() as caught:
            waiter.execute(text("SET lock_timeout = 10"))
            waiter.execute(text("SELECT pg_advisory_xact_lock(1)"))
    (err,) = caught
    assert sqlstate(err) == "55P03"
    assert not is_unavailable(err)


def test_a_deadlock_is_not_unavailability(engine: Engine) -> None:
    with engine.connect() as first, engine.connect() as second, engine.connect() as admin:
        # The first waits longer before it checks for a deadlock: the second is the victim.
        first.execute(text("SET deadlock_timeout = '30s'"))
        first.execute(text("SELECT pg_advisory_xact_lock(1)"))
        second.execute(text("SELECT pg_advisory_xact_lock(2)"))
        first_pid = first.execute(text("SELECT pg_backend_pid()")).scalar_one()
        waiting = threading.Thread(
            target=lambda: first.execute(text("SELECT pg_advisory_xact_lock(2)"))
        )
        waiting.start()
        try:
            wait_for_lock_wait(admin, first_pid)
            with raises_from_database() as caught:
                second.execute(text("SELECT pg_advisory_xact_lock(1)"))
            second.rollback()  # lets the first through
        finally:
            waiting.join(timeout=30)
        first.rollback()
    (err,) = caught
    assert sqlstate(err) == "40P01"
    assert not is_unavailable(err)
    assert is_retryable(err)


def test_a_refused_connection_is_unavailability() -> None:
    engine = make_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/test")
    try:
        with raises_from_database() as caught, engine.connect():
            pass
    finally:
        engine.dispose()
    (err,) = caught
    assert is_unavailable(err)


def test_a_connection_the_server_ended_is_unavailability(engine: Engine) -> None:
    with engine.connect() as conn, engine.connect() as admin:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.commit()
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with raises_from_database() as caught:
            conn.execute(text("SELECT 1"))
    (err,) = caught
    assert is_unavailable(err)
