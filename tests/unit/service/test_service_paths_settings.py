"""TRAINCTL_DATA_ROOTS as both sides read it: os.pathsep-separated folders, by default the
data root; relative paths resolve against the data root, by default the first root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.settings import ServiceSettings
from worker.settings import WorkerSettings


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DATA_ROOT", "DATA_ROOTS", "ARTIFACT_ROOT", "HOME"):
        monkeypatch.delenv(f"TRAINCTL_{name}", raising=False)


def test_the_default_root_is_the_data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    settings = ServiceSettings(home=tmp_path / "home")
    assert settings.data_root == tmp_path
    assert settings.data_roots == (str(tmp_path),)
    explicit = ServiceSettings(home=tmp_path / "home", data_root=tmp_path / "data")
    assert explicit.data_roots == (str(tmp_path / "data"),)
    assert WorkerSettings(home=tmp_path / "home").paths().roots == (tmp_path,)
    worker = WorkerSettings(home=tmp_path / "home", data_root=tmp_path / "data")
    assert worker.paths().roots == (tmp_path / "data",)


def test_roots_are_read_from_the_environment_separated_by_os_pathsep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("TRAINCTL_DATA_ROOTS", f"{a}{os.pathsep} {b} {os.pathsep}")
    monkeypatch.setenv("TRAINCTL_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    settings = ServiceSettings(home=tmp_path / "home")
    assert settings.data_roots == (str(a), str(b))
    assert settings.data_root == a, "relative paths resolve against the first root"
    assert settings.paths.roots == (a, b)
    assert settings.paths.checkpoint_roots == (tmp_path / "artifacts" / "runs",)
    worker = WorkerSettings(home=tmp_path / "home")
    assert worker.paths().roots == (a, b)
    assert worker.paths(tmp_path / "elsewhere").checkpoint_roots == (
        tmp_path / "elsewhere" / "runs",
    )
    monkeypatch.setenv("TRAINCTL_DATA_ROOT", str(b))
    assert ServiceSettings(home=tmp_path / "home").data_root == b
