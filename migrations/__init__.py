"""Alembic migrations: the only way trainctl's schema is created (Postgres and SQLite).

Run them with `service.db.upgrade_database(url)`, or `alembic -c migrations/alembic.ini upgrade
head` with TRAINCTL_DATABASE_URL set.
"""
