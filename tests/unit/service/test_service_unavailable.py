"""`service.errors.is_unavailable` on real SQLite errors: only a database the service cannot
open is unavailable; a lock held too long or a statement that fails is an error in a
statement, which the reaper must not take for deafness (see service/workers/reaper.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from service.errors import is_retryable, is_unavailable


def error_of(url: str, *statements: str, timeout: float = 0.0) -> OperationalError:
    """The error SQLAlchemy raises for the last of `statements`, each in its own connection."""
    engine = create_engine(url, connect_args={"timeout": timeout})
    connections = []
    try:
        with pytest.raises(OperationalError) as raised:
            for statement in statements:
                connection = engine.connect()
                connections.append(connection)
                connection.exec_driver_sql(statement)
        return raised.value
    finally:
        for connection in connections:
            connection.close()
        engine.dispose()


def test_a_database_file_that_cannot_be_opened_is_unavailable(tmp_path: Path) -> None:
    err = error_of(f"sqlite:///{tmp_path / 'no such directory' / 'trainctl.db'}", "SELECT 1")
    assert "unable to open" in str(err.orig)
    assert is_unavailable(err)


def test_a_database_locked_by_another_writer_is_not_unavailable(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'trainctl.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id INTEGER)"))
    engine.dispose()
    # The first connection takes the write lock and keeps it; the second gives up at once.
    err = error_of(url, "BEGIN IMMEDIATE", "INSERT INTO t VALUES (1)")
    assert "database is locked" in str(err.orig)
    assert not is_unavailable(err)
    assert is_retryable(err)  # an API request that meets it answers 503: retry


def test_a_statement_on_a_missing_table_is_not_unavailable(tmp_path: Path) -> None:
    err = error_of(f"sqlite:///{tmp_path / 'trainctl.db'}", "SELECT * FROM no_such_table")
    assert "no such table" in str(err.orig)
    assert not is_unavailable(err)
