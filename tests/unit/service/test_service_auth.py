"""Tokens: stored hashed, written once with mode 0600 for the embedded start."""

from __future__ import annotations

import os
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
    list_tokens,
    revoke_token,
    rotate_token,
    write_token_file,
)
from service.db import make_engine, make_session_factory, upgrade_database
from service.errors import ApiError
from service.models import ApiToken, AuditEvent
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


def test_a_revoked_or_rotated_token_file_is_replaced_never_registered_again(
    session: Session, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    first = ensure_admin_token(session=session, home=home)
    assert first is not None
    (row,) = list_tokens(session=session)
    revoke_token(session=session, token_id=row.id, actor_name="test")
    assert find_token(session=session, token=first) is None

    # The next start writes a new token into the file instead of accepting the revoked one.
    second = ensure_admin_token(session=session, home=home)
    assert second is not None and second != first
    assert (home / "token").read_text().strip() == second
    assert stat.S_IMODE((home / "token").stat().st_mode) == 0o600
    assert find_token(session=session, token=first) is None

    # Rotated elsewhere: the file's old secret is not taken back either.
    (live,) = list_tokens(session=session)
    _, rotated = rotate_token(session=session, token_id=live.id, actor_name="test")
    third = ensure_admin_token(session=session, home=home)
    assert third not in (None, second, rotated)
    assert find_token(session=session, token=second) is None
    assert find_token(session=session, token=rotated) is not None


def test_rotation_keeps_the_token_and_refuses_its_old_secret(session: Session) -> None:
    old = create_token(session=session, name="ci", role="user")
    row = find_token(session=session, token=old)
    assert row is not None
    rotated_row, new = rotate_token(session=session, token_id=row.id, actor_name="test")
    assert (rotated_row.id, rotated_row.role, rotated_row.name) == (row.id, "user", "ci")
    assert find_token(session=session, token=old) is None
    found = find_token(session=session, token=new)
    assert found is not None and found.id == row.id
    revoke_token(session=session, token_id=row.id, actor_name="test")
    assert find_token(session=session, token=new) is None
    with pytest.raises(ApiError) as refused:
        rotate_token(session=session, token_id=row.id, actor_name="test")
    assert refused.value.code == "token_revoked"
    actions = session.scalars(select(AuditEvent.action).order_by(AuditEvent.id)).all()
    assert actions == ["token.create", "token.rotate", "token.revoke"]


def test_a_token_file_is_written_0600_whatever_the_umask_and_the_file_before(
    tmp_path: Path,
) -> None:
    path = tmp_path / "secrets" / "token"
    path.parent.mkdir()
    path.write_text("old\n")
    path.chmod(0o666)
    before = os.umask(0)
    try:
        write_token_file(path, "new-secret")
    finally:
        os.umask(before)
    assert path.read_text() == "new-secret\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temporary file left


def test_rotating_an_embedded_token_rewrites_the_file_that_held_it(
    session: Session, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    admin = ensure_admin_token(session=session, home=home)
    worker = ensure_worker_token(session=session, home=home)
    assert admin is not None and worker is not None
    by_name = {row.name: row for row in list_tokens(session=session)}

    _, new_admin = rotate_token(session=session, token_id=by_name["admin (embedded)"].id, home=home)
    assert (home / "token").read_text().strip() == new_admin
    assert (home / "worker-token").read_text().strip() == worker  # not the token rotated
    assert stat.S_IMODE((home / "token").stat().st_mode) == 0o600

    _, new_worker = rotate_token(
        session=session, token_id=by_name["worker (embedded)"].id, home=home
    )
    assert (home / "worker-token").read_text().strip() == new_worker
    assert (home / "token").read_text().strip() == new_admin

    # Another token's rotation, or one without a home, leaves the files alone.
    other = find_token(session=session, token=create_token(session=session, name="x", role="user"))
    assert other is not None
    rotate_token(session=session, token_id=other.id, home=home)
    rotate_token(session=session, token_id=by_name["admin (embedded)"].id)
    assert (home / "token").read_text().strip() == new_admin


def test_revoking_the_callers_own_token_is_refused_unless_allowed(session: Session) -> None:
    own = find_token(session=session, token=create_token(session=session, name="me", role="admin"))
    assert own is not None
    with pytest.raises(ApiError) as refused:
        revoke_token(session=session, token_id=own.id, caller=own.id)
    assert (refused.value.status, refused.value.code) == (409, "revoking_own_token")
    assert "allow_self=true" in refused.value.message
    assert own.revoked_at is None

    other = find_token(session=session, token=create_token(session=session, name="o", role="user"))
    assert other is not None
    assert revoke_token(session=session, token_id=other.id, caller=own.id).revoked_at is not None
    revoked = revoke_token(session=session, token_id=own.id, caller=own.id, allow_self=True)
    assert revoked.revoked_at is not None
    # Revoked already: again is the no-op it always was, not a refusal.
    revoke_token(session=session, token_id=own.id, caller=own.id)
