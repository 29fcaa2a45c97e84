"""Bearer tokens. A token is shown once, when created; the database keeps its SHA-256 only.

Admin tokens use the public API; worker tokens use `/internal/...` and nothing else.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db import make_engine, make_session_factory
from service.models import ApiToken, TokenRole
from service.settings import ServiceSettings

ADMIN_TOKEN_FILE = "token"
WORKER_TOKEN_FILE = "worker-token"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


def create_token(*, session: Session, name: str, role: TokenRole) -> str:
    """Create and commit a token; return it (the only time it exists in clear)."""
    token = new_token()
    session.add(ApiToken(name=name, role=role, token_sha256=hash_token(token)))
    session.commit()
    return token


def find_token(*, session: Session, token: str) -> ApiToken | None:
    return session.scalars(
        select(ApiToken).where(ApiToken.token_sha256 == hash_token(token))
    ).one_or_none()


def ensure_token_file(*, session: Session, path: Path, name: str, role: TokenRole) -> str | None:
    """Make sure `path` holds a token of `role` that this database accepts.

    Creates the token and writes it with mode 0600 when the file does not exist, and returns it;
    returns None when the file already existed (its token is registered if the database is new,
    so that a reset database keeps accepting the token on disk)."""
    if path.exists():
        token = path.read_text().strip()
        if token and find_token(session=session, token=token) is None:
            session.add(ApiToken(name=name, role=role, token_sha256=hash_token(token)))
            session.commit()
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    # O_EXCL: two processes starting at once cannot both write (one gets FileExistsError).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    session.add(ApiToken(name=name, role=role, token_sha256=hash_token(token)))
    session.commit()
    return token


def ensure_admin_token(*, session: Session, home: Path) -> str | None:
    """Embedded start: `<home>/token` holds an admin token (created when missing)."""
    return ensure_token_file(
        session=session, path=Path(home) / ADMIN_TOKEN_FILE, name="admin (embedded)", role="admin"
    )


def ensure_worker_token(*, session: Session, home: Path) -> str | None:
    """Embedded start: `<home>/worker-token` holds a worker token (created when missing)."""
    return ensure_token_file(
        session=session,
        path=Path(home) / WORKER_TOKEN_FILE,
        name="worker (embedded)",
        role="worker",
    )


@dataclass(frozen=True)
class Tokens:
    # repr=False: a logged Tokens object must not leak the secrets.
    admin: str = field(repr=False)
    worker: str = field(repr=False)


def ensure_tokens(settings: ServiceSettings) -> Tokens:
    """Embedded start (`trainctl up`): both token files exist and are accepted by the database
    at settings.database_url (migrated already); returns both tokens, read from the files."""
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            ensure_admin_token(session=session, home=settings.home)
            ensure_worker_token(session=session, home=settings.home)
    finally:
        engine.dispose()
    return Tokens(
        admin=(settings.home / ADMIN_TOKEN_FILE).read_text().strip(),
        worker=(settings.home / WORKER_TOKEN_FILE).read_text().strip(),
    )
