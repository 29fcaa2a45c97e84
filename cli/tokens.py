"""`trainctl tokens`: list, create, revoke and rotate API tokens.

The token commands work on the database, not through the API: the first admin token can only be
made there, and a lost or leaked admin token can be revoked there. Their audit events name the
local user and host instead of a token.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import EXIT_BAD_INPUT, JsonOpt, console, err_console, fail
from cli.config import get_settings

tokens_app = typer.Typer(
    help="List, create, revoke and rotate API tokens (on the database: needs "
    "TRAINCTL_DATABASE_URL, and works before any token exists).",
    no_args_is_help=True,
)


class Role(StrEnum):
    admin = "admin"
    user = "user"
    viewer = "viewer"
    worker = "worker"


TokenId = Annotated[str, typer.Argument(help="The token's id (tok_...), as `tokens list` shows.")]


def _token_session() -> Any:
    from service.db import make_session_factory, upgrade_database
    from service.settings import ServiceSettings

    settings = ServiceSettings()
    upgrade_database(settings.database_url)
    return make_session_factory(settings.database_url)()


def _cli_actor() -> dict[str, str]:
    import getpass
    import socket

    return {"actor_name": f"trainctl tokens ({getpass.getuser()})", "address": socket.gethostname()}


def _token_call(action: Any) -> Any:
    from service.errors import ApiError as ServiceError

    try:
        return action()
    except ServiceError as err:
        raise fail(f"{err.message} [{err.code}]", EXIT_BAD_INPUT) from err


def _write_secret(secret: str, out: Path | None) -> None:
    """Print the secret, or write it to `out` with mode 0600 (never printed then)."""
    if out is None:
        print(secret)
        return
    from service.auth import write_token_file

    write_token_file(out, secret)
    err_console.print(f"written to {out} (mode 0600)")


OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Write the secret to this file (mode 0600, replaced whole) instead of printing it.",
    ),
]


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="A label for the token.")],
    role: Annotated[
        Role,
        typer.Option(
            help="user (its own runs and jobs; the default, as POST /tokens), viewer (reads "
            "only), worker (/internal only) or admin (everything)."
        ),
    ] = Role.user,
    out: OutOpt = None,
    max_devices: Annotated[
        int | None,
        typer.Option(
            "--max-devices",
            min=0,
            help="The most devices its runs hold placed or running at once (default: unlimited).",
        ),
    ] = None,
) -> None:
    """Create a token in the database named by TRAINCTL_DATABASE_URL and print it once."""
    from service.auth import create_token

    with _token_session() as session:
        token = create_token(
            session=session,
            name=name,
            role=role.value,
            max_devices=max_devices,
            **_cli_actor(),
        )
    _write_secret(token, out)


@tokens_app.command("update")
def tokens_update(
    token_id: Annotated[str, typer.Argument(help="The token's id (tokens list).")],
    max_devices: Annotated[
        int | None,
        typer.Option(
            "--max-devices",
            min=0,
            help="The most devices its runs hold placed or running at once.",
        ),
    ] = None,
    unlimited: Annotated[bool, typer.Option("--unlimited", help="Remove its device cap.")] = False,
) -> None:
    """Change a token's device quota in the database named by TRAINCTL_DATABASE_URL (PATCH
    /tokens/{id} over the API). Queued attempts over it wait; running ones are not stopped."""
    from service.auth import set_max_devices

    if (max_devices is None) == (not unlimited):
        raise typer.BadParameter("give exactly one of --max-devices N or --unlimited")
    with _token_session() as session:
        row = _token_call(
            lambda: set_max_devices(
                session=session, token_id=token_id, max_devices=max_devices, **_cli_actor()
            )
        )
        cap = "unlimited" if row.max_devices is None else f"{row.max_devices} devices"
    print(f"token {token_id}: {cap}")


@tokens_app.command("list")
def tokens_list(
    revoked: Annotated[bool, typer.Option("--revoked", help="List revoked tokens too.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """List tokens (never their secrets), oldest first."""
    from service.auth import list_tokens

    with _token_session() as session:
        rows: list[dict[str, str | None]] = [
            {
                "id": t.id,
                "name": t.name,
                "role": t.role,
                "created_at": t.created_at.isoformat(),
                "rotated_at": None if t.rotated_at is None else t.rotated_at.isoformat(),
                "revoked_at": None if t.revoked_at is None else t.revoked_at.isoformat(),
                "max_devices": None if t.max_devices is None else str(t.max_devices),
            }
            for t in list_tokens(session=session, revoked=revoked)
        ]
    if as_json:
        print(json.dumps({"tokens": rows, "count": len(rows)}, indent=2))
        return
    table = Table()
    for column in ("id", "name", "role", "max devices", "created", "rotated", "revoked"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["id"],
            row["name"],
            row["role"],
            row["max_devices"] or "",
            row["created_at"],
            row["rotated_at"] or "",
            row["revoked_at"] or "",
        )
    console.print(table)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: TokenId,
    allow_self: Annotated[
        bool,
        typer.Option(
            "--allow-self",
            help="Revoke it even when it is the token this CLI uses (TRAINCTL_TOKEN, else "
            "~/.trainctl/token): the CLI is locked out after.",
        ),
    ] = False,
) -> None:
    """Revoke a token: the service refuses it from its next request on. The token this CLI
    itself uses is refused without --allow-self."""
    from service.auth import find_token, revoke_token

    own = get_settings().resolved_token()
    with _token_session() as session:
        mine = find_token(session=session, token=own) if own else None
        row = _token_call(
            lambda: revoke_token(
                session=session,
                token_id=token_id,
                caller=None if mine is None else mine.id,
                allow_self=allow_self,
                **_cli_actor(),
            )
        )
        print(f"revoked {row.id} ({row.name}, {row.role})")


@tokens_app.command("rotate")
def tokens_rotate(token_id: TokenId, out: OutOpt = None) -> None:
    """Give a token a new secret (same id, role and runs) and print it once; the old secret is
    refused from the next request on. The embedded stack's token files (~/.trainctl/token and
    worker-token, under TRAINCTL_HOME) that held the old secret are rewritten with the new one,
    so its CLI and workers go on without a restart."""
    from service.auth import rotate_token

    home = get_settings().home
    with _token_session() as session:
        _, secret = _token_call(
            lambda: rotate_token(session=session, token_id=token_id, home=home, **_cli_actor())
        )
    _write_secret(secret, out)
