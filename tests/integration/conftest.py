"""Integration fixtures: real Postgres and Redis, isolated per test.

Every test that asks for a database gets its own (`CREATE DATABASE tc_<uuid>`, dropped
afterwards), and every settings object its own Celery queue, so tests run in parallel
(pytest-xdist) without sharing state. A server that cannot be reached fails the test loudly;
nothing is skipped.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from fastapi.testclient import TestClient
from psycopg import sql
from sqlalchemy.orm import Session, sessionmaker

from service.api.app import create_app
from service.auth import create_token
from service.db import make_engine, make_session_factory, upgrade_database
from service.settings import ServiceSettings

# The maintenance database used to create and drop the per-test ones.
POSTGRES_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _admin_connection() -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as err:
        pytest.fail(
            f"Postgres at {POSTGRES_ADMIN_URL} is unreachable ({err}); start it (make services) "
            "or point TEST_POSTGRES_URL at one",
            pytrace=False,
        )


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    """A fresh, empty Postgres database for this test only (no tables); dropped afterwards."""
    name = f"tc_{uuid.uuid4().hex}"
    with _admin_connection() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        with _admin_connection() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind in turn (no tables): a SQLite file, then a fresh
    Postgres database (`empty_postgres_url`). For migrations, which must hold on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'trainctl.db'}"
    url: str = request.getfixturevalue("empty_postgres_url")
    return url


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """The maintenance database's URL, for tests that act on their own database from outside."""
    return POSTGRES_ADMIN_URL


@pytest.fixture
def postgres_url(empty_postgres_url: str) -> str:
    """A fresh Postgres database for this test only, migrated to the latest revision."""
    upgrade_database(empty_postgres_url)
    return empty_postgres_url


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis broker URL, after checking that Redis answers."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as err:
        pytest.fail(
            f"Redis at {REDIS_URL} is unreachable ({err}); start it (make services) or point "
            "TEST_REDIS_URL at one",
            pytrace=False,
        )
    finally:
        client.close()
    return REDIS_URL


SettingsFactory = Callable[..., ServiceSettings]


@pytest.fixture
def make_settings(tmp_path: Path, postgres_url: str, redis_url: str) -> Iterator[SettingsFactory]:
    """`make_settings(**overrides) -> ServiceSettings` for a home under tmp_path, this test's
    Postgres database, Redis, and a queue no other test uses (its Redis keys are deleted
    afterwards). Relative workflow paths resolve against `tmp_path / "data"`."""
    queues: list[str] = []

    def make(**overrides: Any) -> ServiceSettings:
        queue = f"tc-test-{uuid.uuid4().hex[:12]}"
        queues.append(overrides.get("queue", queue))
        values: dict[str, Any] = {
            "home": tmp_path / "home",
            "database_url": postgres_url,
            "broker_url": redis_url,
            "queue": queue,
            "artifact_root": tmp_path / "artifacts",
            "data_root": tmp_path / "data",
            **overrides,
        }
        return ServiceSettings(**values)

    yield make

    client = redis.Redis.from_url(redis_url)
    try:
        for queue in queues:
            # The queue's list and kombu's binding keys (their names vary across versions).
            client.delete(queue, *client.scan_iter(match=f"_kombu.binding*.{queue}"))
            # Workers' own queues (contracts.dispatch.worker_queue) and their bindings.
            own = [*client.scan_iter(match=f"{queue}.worker.*")]
            own += [*client.scan_iter(match=f"_kombu.binding*.{queue}.worker.*")]
            if own:
                client.delete(*own)
    finally:
        client.close()


@dataclass
class Api:
    """A running app (TestClient, lifespan entered) with an admin and a worker token."""

    client: TestClient
    settings: ServiceSettings
    sessions: sessionmaker[Session]
    admin: dict[str, str]
    worker: dict[str, str]


ApiFactory = Callable[[ServiceSettings], Api]


@pytest.fixture
def make_api() -> Iterator[ApiFactory]:
    """`make_api(settings) -> Api`: the app over `settings`, closed after the test."""
    with ExitStack() as stack:

        def make(settings: ServiceSettings) -> Api:
            engine = make_engine(settings.database_url)
            stack.callback(engine.dispose)
            sessions = make_session_factory(engine)
            with sessions() as session:
                admin = create_token(session=session, name="test admin", role="admin")
                worker = create_token(session=session, name="test worker", role="worker")
            client = stack.enter_context(TestClient(create_app(settings)))
            return Api(
                client=client,
                settings=settings,
                sessions=sessions,
                admin={"Authorization": f"Bearer {admin}"},
                worker={"Authorization": f"Bearer {worker}"},
            )

        yield make


WorkflowFactory = Callable[..., dict[str, Any]]


@pytest.fixture
def tiny_workflow(tmp_path: Path) -> WorkflowFactory:
    """`tiny_workflow(phases=2, steps=10, name="tiny") -> dict`: a valid workflow document with
    paths relative to `tmp_path / "data"` (the data_root of make_settings), its files written
    there. The service only hashes files, so their contents are small stand-ins."""
    data = tmp_path / "data"

    def make(*, phases: int = 2, steps: int = 10, name: str = "tiny") -> dict[str, Any]:
        data.mkdir(parents=True, exist_ok=True)
        (data / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
        (data / "pretrain.jsonl").write_text('{"text": "the quick brown fox"}\n')
        (data / "summaries.jsonl").write_text('{"source": "a long text", "target": "short"}\n')
        objectives = ["continued_pretrain", "summarization"]
        return {
            "name": name,
            "model": {"config": {"vocab_size": 256, "max_position_embeddings": 128}},
            "tokenizer": "tokenizer.json",
            "microbatch_tokens": 128,
            "evals": [{"task": "summarization", "data": "summaries.jsonl", "every_steps": 5}],
            "phases": [
                {
                    "name": f"phase{i}",
                    "objective": objectives[min(i, 1)],
                    "data": [{"path": "pretrain.jsonl" if i == 0 else "summaries.jsonl"}],
                    "sequence_length": 64,
                    "microbatch_size": 2,
                    "steps": steps,
                }
                for i in range(phases)
            ],
        }

    return make
