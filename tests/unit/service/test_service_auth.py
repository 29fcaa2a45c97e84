"""Tokens: stored hashed, written once with mode 0600 for the embedded start."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.auth import (
    create_token,
    ensure_admin_token,
    ensure_tokens,
    ensure_worker_token,
    find_token,
    hash_token,
)
from service.db import make_engine, make_session_factory, upgrade_database
from service.models import ApiToken
from service.settings import ServiceSettings


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    url = f"sqlite:///{tmp_path / 'auth.db'}"
    upgrade_database(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


def test_hash_token_is_sha256_hex_and_distinguishes_tokens() -> None:
    assert len(hash_token("a")) == 64
    assert hash_token("a") != hash_token("b")
    assert hash_token("a") == hash_token("a")


def test_created_token_is_stored_only_as_its_hash(session: Session) -> None:
    token = create_token(session=session, name="ci", role="worker")
    (row,) = session.scalars(select(ApiToken)).all()
    assert row.token_sha256 == hash_token(token)
    assert token not in (row.token_sha256, row.name, row.id)
    found = find_token(session=session, token=token)
    assert found is not None and found.role == "worker"
    assert find_token(session=session, token=token + "x") is None


def test_admin_token_file_is_written_once_with_mode_0600(session: Session, tmp_path: Path) -> None:
    home = tmp_path / "home"
    token = ensure_admin_token(session=session, home=home)
    assert token is not None
    path = home / "token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() == token
    assert ensure_admin_token(session=session, home=home) is None
    found = find_token(session=session, token=token)
    assert found is not None and found.role == "admin"


def test_token_file_from_an_earlier_database_is_registered_again(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home).mkdir()
    (home / "worker-token").write_text("kept-from-before\n")
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade_database(url)
    with make_session_factory(url)() as session:
        assert ensure_worker_token(session=session, home=home) is None
        found = find_token(session=session, token="kept-from-before")
        assert found is not None and found.role == "worker"


def test_ensure_tokens_returns_both_tokens_and_is_stable(tmp_path: Path) -> None:
    settings = ServiceSettings(home=tmp_path / "home")
    upgrade_database(settings.database_url)
    first = ensure_tokens(settings)
    assert first.admin != first.worker
    assert ensure_tokens(settings) == first
