"""Settings: embedded defaults under home, and a bad value stops the process at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from contracts.dispatch import DEFAULT_QUEUE
from service.db import normalize_url
from service.settings import ServiceSettings


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOME", "DATABASE_URL", "BROKER_URL", "ARTIFACT_ROOT", "QUEUE", "DATA_ROOT"):
        monkeypatch.delenv(f"TRAINCTL_{name}", raising=False)


def test_embedded_defaults_live_under_home(tmp_path: Path) -> None:
    settings = ServiceSettings(home=tmp_path)
    assert settings.database_url == f"sqlite:///{tmp_path / 'trainctl.db'}"
    assert settings.broker_url == f"filesystem://{tmp_path / 'broker'}"
    assert settings.artifact_root == str(tmp_path / "artifacts")
    assert settings.queue == DEFAULT_QUEUE
    assert settings.lease_seconds == 60
    assert settings.max_preemptions == 10
    assert settings.max_restarts == 3
    assert settings.reaper_interval_seconds == 5


def test_environment_is_read_with_the_trainctl_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINCTL_HOME", str(tmp_path))
    monkeypatch.setenv("TRAINCTL_QUEUE", "gpu-a100")
    monkeypatch.setenv("TRAINCTL_LEASE_SECONDS", "15")
    settings = ServiceSettings()
    assert settings.home == tmp_path
    assert settings.queue == "gpu-a100"
    assert settings.lease_seconds == 15
    assert settings.database_url.endswith("/trainctl.db")


@pytest.mark.parametrize(
    "field, value",
    [
        ("database_url", "mysql://db/x"),
        ("broker_url", "kafka://x"),
        ("api_url", "localhost:8600"),
        ("lease_seconds", 0),
        ("outbox_interval_seconds", -1),
        ("max_preemptions", -1),
        ("max_restarts", -1),
        ("reaper_interval_seconds", 0),
        ("queue", ""),
    ],
)
def test_bad_values_fail_fast_naming_the_setting(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        ServiceSettings(home=tmp_path, **{field: value})


def test_postgres_urls_use_psycopg_3() -> None:
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("sqlite:///x.db") == "sqlite:///x.db"
