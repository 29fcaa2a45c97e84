"""The CLI's settings, read from the environment once."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINCTL_")

    home: Path = Field(
        Path.home() / ".trainctl",
        description="The embedded stack's folder, where `up` writes the admin token (home/token).",
    )
    api_url: str = Field("http://127.0.0.1:8600", description="The API the CLI talks to.")
    token: str = Field(
        "",
        description="The CLI's bearer token; empty: the one in home/token (written by the "
        "embedded stack).",
    )

    def resolved_token(self) -> str:
        if self.token:
            return self.token
        path = self.home / "token"
        return path.read_text().strip() if path.exists() else ""


@lru_cache
def get_settings() -> CliSettings:
    return CliSettings()
