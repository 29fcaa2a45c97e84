"""Alembic is the only way the schema is made: up, down and up again, on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from service.db import downgrade_database, make_engine, upgrade_database
from service.models import Base

pytestmark = pytest.mark.integration

TABLES = {
    "workflows",
    "runs",
    "attempts",
    "checkpoints",
    "metrics",
    "evals",
    "outbox",
    "api_tokens",
    "jobs",
}


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def schema_drift(url: str) -> list[object]:
    """Differences between the migrated schema and the models (empty when in step)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def assert_up_down_up(url: str) -> None:
    upgrade_database(url)
    assert tables(url) == TABLES
    assert schema_drift(url) == []
    downgrade_database(url, "base")
    assert tables(url) == set()
    upgrade_database(url)
    assert tables(url) == TABLES


def test_migrations_upgrade_downgrade_upgrade_on_postgres(empty_postgres_url: str) -> None:
    assert_up_down_up(empty_postgres_url)


def test_migrations_upgrade_downgrade_upgrade_on_sqlite(tmp_path: Path) -> None:
    assert_up_down_up(f"sqlite:///{tmp_path / 'nested' / 'trainctl.db'}")
