"""The CLI's settings, read from the environment once."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class CliSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINCTL_")

    home: Path = Path.home() / ".trainctl"
    api_url: str = "http://127.0.0.1:8600"
    # When empty, the token is read from <home>/token (written by the embedded stack).
    token: str = ""

    def resolved_token(self) -> str:
        if self.token:
            return self.token
        path = self.home / "token"
        return path.read_text().strip() if path.exists() else ""


@lru_cache
def get_settings() -> CliSettings:
    return CliSettings()
