"""Engine, sessions and schema upgrades. The schema is created by Alembic only."""

from __future__ import annotations

import importlib.util
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Result, create_engine, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.models import utcnow

# How long a SQLite writer waits for the file lock before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalize_url(url: str) -> str:
    """psycopg 3 is the only Postgres driver installed; name it whatever the user wrote."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url.removeprefix(prefix)
    return url


def make_engine(url: str) -> Engine:
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)

    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    # The API serves requests from a thread pool; SQLite's own locking serialises writers.
    engine = create_engine(url, connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        # WAL lets readers proceed while the one writer commits.
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def make_session_factory(engine: Engine | str) -> sessionmaker[Session]:
    """Sessions over `engine` (or over a new engine for a URL: one-shot commands)."""
    if isinstance(engine, str):
        engine = make_engine(engine)
    # expire_on_commit=False: routes build their answer from objects after committing.
    return sessionmaker(bind=engine, expire_on_commit=False)


def migrations_dir() -> Path:
    """Where the `migrations` package lies, found without importing it: its env.py imports
    this package, and the arrow runs one way (migrations -> service). find_spec of a top-level
    name runs none of the package's code."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the `migrations` package is not installed beside `service`; reinstall trainctl"
        )
    # Its search locations, not its origin: an editable install made before
    # migrations/__init__.py existed finds it as a namespace package, which has no file.
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["database_url"] = normalize_url(url)
    return config


def upgrade_database(url: str, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (Alembic `upgrade`)."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade_database(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def insert_for(session: Session, model: Any) -> Any:
    """An INSERT that supports ON CONFLICT for the session's dialect (Postgres or SQLite)."""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(model)
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert(model)


def database_now(session: Session) -> datetime:
    """The database's clock. Leases and stall clocks are written and judged by it, so
    replicas whose own clocks disagree still agree on every lease. Postgres: one round trip
    (`clock_timestamp()`, the time now, not the transaction's start). SQLite runs in this
    process, so its clock is this process's own."""
    if session.get_bind().dialect.name != "postgresql":
        return utcnow()
    now: datetime = session.execute(select(func.clock_timestamp())).scalar_one()
    return now.astimezone(UTC)


def rowcount(result: Result[Any]) -> int:
    """Rows matched by an UPDATE/INSERT: who won a conditional UPDATE."""
    return cast(CursorResult[Any], result).rowcount
