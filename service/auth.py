"""Bearer tokens. A token is shown once, when created or rotated; the database keeps its
SHA-256 only. Roles are described in service.access: admin, user and viewer tokens use the
public API, worker tokens `/internal/...` and nothing else.

A revoked token keeps its row (`revoked_at`) and is refused from the next request on. Rotation
gives the same token (id, name, role, what it owns) a new secret; the old one is refused at
once. Token files are written with mode 0600 (`write_token_file`), and the secret never
appears in a log, an error message or a URL.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import audit
from service.audit import AuditAction
from service.db import make_engine, make_session_factory
from service.errors import ApiError, not_found
from service.models import ApiToken, TokenRole, utcnow
from service.settings import ServiceSettings

ADMIN_TOKEN_FILE = "token"
WORKER_TOKEN_FILE = "worker-token"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


def _record(
    session: Session,
    action: AuditAction,
    row: ApiToken,
    *,
    actor_name: str | None,
    address: str | None,
) -> None:
    """The audit event of a change to the token `row`, naming it and its role."""
    audit.record(
        session,
        action,
        row.id,
        details={"name": row.name, "role": row.role},
        actor_name=actor_name,
        address=address,
    )


def create_token(
    *,
    session: Session,
    name: str,
    role: TokenRole,
    actor_name: str | None = None,
    address: str | None = None,
    max_devices: int | None = None,
) -> str:
    """Create a token and commit it with its audit event; return it (the only time it exists
    in clear). The event's actor is the request's token, else `actor_name`."""
    return issue_token(
        session=session,
        name=name,
        role=role,
        actor_name=actor_name,
        address=address,
        max_devices=max_devices,
    )[1]


def issue_token(
    *,
    session: Session,
    name: str,
    role: TokenRole,
    actor_name: str | None = None,
    address: str | None = None,
    max_devices: int | None = None,
) -> tuple[ApiToken, str]:
    """`create_token`, returning the row too."""
    token = new_token()
    row = ApiToken(name=name, role=role, token_sha256=hash_token(token), max_devices=max_devices)
    session.add(row)
    session.flush()
    _record(session, "token.create", row, actor_name=actor_name, address=address)
    session.commit()
    return row, token


def set_max_devices(
    *,
    session: Session,
    token_id: str,
    max_devices: int | None,
    actor_name: str | None = None,
    address: str | None = None,
) -> ApiToken:
    """Set the owner's device quota (None: unlimited) and commit it with its audit event. The
    next placement pass holds its queued attempts to it; running ones are not stopped."""
    row = get_token(session=session, token_id=token_id, lock=True)
    row.max_devices = max_devices
    _record(session, "token.update", row, actor_name=actor_name, address=address)
    session.commit()
    return row


def find_token(*, session: Session, token: str) -> ApiToken | None:
    """The live (not revoked) token with this secret."""
    return session.scalars(
        select(ApiToken).where(
            ApiToken.token_sha256 == hash_token(token), ApiToken.revoked_at.is_(None)
        )
    ).one_or_none()


def list_tokens(*, session: Session, revoked: bool = False) -> list[ApiToken]:
    """Tokens oldest first; revoked ones too when `revoked`."""
    query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if not revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    return list(session.scalars(query))


def get_token(*, session: Session, token_id: str, lock: bool = False) -> ApiToken:
    """The token; 404 `token_not_found`. With `lock`, its row stays locked until commit."""
    row = session.get(ApiToken, token_id, with_for_update=lock)
    if row is None:
        raise not_found("token", token_id, "list tokens with GET /tokens")
    return row


def revoke_token(
    *,
    session: Session,
    token_id: str,
    caller: str | None = None,
    allow_self: bool = False,
    actor_name: str | None = None,
    address: str | None = None,
) -> ApiToken:
    """Revoke the token and commit with its audit event; a revoked token again is a no-op.
    `caller`: the id of the token the request is made with (or the one the CLI itself uses),
    which may revoke itself only with `allow_self`: 409 `revoking_own_token` otherwise, since
    that locks the caller out (the embedded stack's CLI, say, whose token is in its home)."""
    row = get_token(session=session, token_id=token_id, lock=True)
    if row.revoked_at is None and token_id == caller and not allow_self:
        session.rollback()
        raise ApiError(
            409,
            "revoking_own_token",
            f"token {token_id} ({row.name!r}) is the one this request is made with: revoking it "
            "locks this client out; rotate it instead (its token file is rewritten), or revoke "
            "it with allow_self=true (`trainctl tokens revoke --allow-self`)",
            {"token_id": token_id},
        )
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        _record(session, "token.revoke", row, actor_name=actor_name, address=address)
    session.commit()
    return row


def rotate_token(
    *,
    session: Session,
    token_id: str,
    home: Path | None = None,
    actor_name: str | None = None,
    address: str | None = None,
) -> tuple[ApiToken, str]:
    """Give the token a new secret and commit with its audit event; return the row and the
    new secret. The old secret is refused from the next request on; id, name, role and what the
    token owns stay. 409 `token_revoked` for a revoked token.

    With `home`, the embedded stack's token files there (`token`, `worker-token`) that held the
    old secret are rewritten with the new one, after the commit: the CLI and the embedded
    workers read them at each request, so rotating their token locks nobody out."""
    row = get_token(session=session, token_id=token_id, lock=True)
    if row.revoked_at is not None:
        session.rollback()
        raise ApiError(
            409,
            "token_revoked",
            f"token {token_id} ({row.name!r}) was revoked; create a new one instead",
            {"token_id": token_id},
        )
    old = row.token_sha256
    token = new_token()
    row.token_sha256 = hash_token(token)
    row.rotated_at = utcnow()
    _record(session, "token.rotate", row, actor_name=actor_name, address=address)
    session.commit()
    if home is not None:
        rewrite_token_files(home=home, old_sha256=old, token=token)
    return row, token


def rewrite_token_files(*, home: Path, old_sha256: str, token: str) -> list[Path]:
    """Write `token` into each embedded token file under `home` that holds the secret whose
    SHA-256 is `old_sha256`; return the files rewritten."""
    rewritten = []
    for name in (ADMIN_TOKEN_FILE, WORKER_TOKEN_FILE):
        path = Path(home) / name
        try:
            held = path.read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
        if held and hash_token(held) == old_sha256:
            write_token_file(path, token)
            rewritten.append(path)
    return rewritten


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path` with mode 0600, replacing the file whole: the secret is never
    readable by others, not even for a moment, nor half written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def ensure_token_file(*, session: Session, path: Path, name: str, role: TokenRole) -> str | None:
    """Make sure `path` holds a token of `role` that this database accepts.

    Creates the token and writes it with mode 0600 when the file does not exist, and returns it;
    returns None when the file already existed (its token is registered if the database holds
    no token of that name, so that a reset database keeps accepting the token on disk). A file
    whose token the database revoked or rotated away is replaced by a new token (and returns
    it): a revoked secret is never registered again."""
    if path.exists():
        token = path.read_text().strip()
        if token and find_token(session=session, token=token) is not None:
            return None
        known = session.scalars(
            select(ApiToken).where(
                (ApiToken.token_sha256 == hash_token(token)) | (ApiToken.name == name)
            )
        ).first()
        if token and known is None:
            session.add(ApiToken(name=name, role=role, token_sha256=hash_token(token)))
            session.commit()
            return None
        token = new_token()
        write_token_file(path, token)
        session.add(ApiToken(name=name, role=role, token_sha256=hash_token(token)))
        session.commit()
        return token
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
