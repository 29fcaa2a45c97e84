"""`trainctl tokens` on the embedded stack's SQLite database: least privilege by default, and
no revoking the token the CLI itself uses by accident."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.config import get_settings
from cli.main import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("TRAINCTL_HOME", str(tmp_path / "home"))
    for name in ("TRAINCTL_DATABASE_URL", "TRAINCTL_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield tmp_path / "home"
    get_settings.cache_clear()


def listed() -> dict[str, dict[str, str]]:
    result = runner.invoke(app, ["tokens", "list", "--json"])
    assert result.exit_code == 0, result.output
    return {t["name"]: t for t in json.loads(result.stdout)["tokens"]}


def test_tokens_create_defaults_to_the_user_role() -> None:
    result = runner.invoke(app, ["tokens", "create", "--name", "alice"])
    assert result.exit_code == 0, result.output
    assert listed()["alice"]["role"] == "user"


def test_tokens_revoke_refuses_the_clis_own_token_without_allow_self(home: Path) -> None:
    out = home / "token"
    made = runner.invoke(
        app, ["tokens", "create", "--name", "me", "--role", "admin", "--out", str(out)]
    )
    assert made.exit_code == 0, made.output
    mine = listed()["me"]["id"]
    refused = runner.invoke(app, ["tokens", "revoke", mine])
    assert refused.exit_code != 0
    assert "--allow-self" in refused.output and "me" in listed()
    revoked = runner.invoke(app, ["tokens", "revoke", mine, "--allow-self"])
    assert revoked.exit_code == 0, revoked.output
    assert "me" not in listed()
