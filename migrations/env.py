"""Alembic environment. The database URL comes from `config.attributes["database_url"]`
(set by service.db.upgrade_database), else from TRAINCTL_DATABASE_URL via the settings."""

from __future__ import annotations

from alembic import context

from service.db import make_engine, normalize_url
from service.models import Base

config = context.config
target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return str(url)
    from service.settings import ServiceSettings

    return normalize_url(ServiceSettings().database_url)


def run_migrations_offline() -> None:
    context.configure(
        url=database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url())
    sqlite = engine.dialect.name == "sqlite"
    try:
        with engine.connect() as connection:
            if sqlite:
                # A batch ALTER copies a table and drops the old one; with foreign keys on
                # (service.db turns them on for every connection), that DROP cascades and
                # deletes every row that references the table. Off for the migration (it is a
                # no-op inside a transaction, so before one), checked after it.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            # render_as_batch: SQLite alters tables by copying them; Postgres ignores it.
            context.configure(
                connection=connection, target_metadata=target_metadata, render_as_batch=True
            )
            with context.begin_transaction():
                context.run_migrations()
            if sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if broken:
                    raise RuntimeError(f"the migration left dangling references: {broken[:5]}")
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
