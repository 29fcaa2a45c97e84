from __future__ import annotations

from pathlib import Path

import pytest

from runtime.path import path_problem, resolve_path, resolve_paths


def test_a_relative_path_resolves_against_the_base(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert resolve_path("data/a.jsonl", tmp_path) == str(tmp_path / "data" / "a.jsonl")
    assert resolve_path("link/../x", tmp_path) == str(tmp_path / "x")


def test_an_absolute_path_is_kept_as_written_and_home_is_expanded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_path("/data/./a.jsonl", Path("/base")) == "/data/./a.jsonl"
    assert resolve_path("~/a.jsonl", Path("/base")) == str(tmp_path / "a.jsonl")
    assert resolve_path("", Path("/base")) == ""


def test_a_path_the_os_cannot_use_is_kept_as_given(tmp_path: Path) -> None:
    assert resolve_path("tok\0.json", tmp_path) == "tok\0.json"
    assert resolve_path("~no-such-user-here/a", tmp_path) == "~no-such-user-here/a"


def test_path_problem_names_the_path_and_what_it_should_be(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    missing = tmp_path / "gone"
    assert path_problem(str(tmp_path / "f"), "file") is None
    assert path_problem(str(tmp_path), "directory") is None
    assert path_problem(str(tmp_path), "path") is None
    assert path_problem(str(missing), "file") == f"file {missing} not found"
    assert path_problem(str(missing), "path") == f"file {missing} not found"
    assert path_problem(str(missing), "directory") == f"directory {missing} not found"
    assert path_problem(str(tmp_path), "file") == f"{tmp_path} is not a regular file"
    assert path_problem(str(tmp_path / "f"), "directory") == f"{tmp_path / 'f'} is not a directory"
    assert path_problem("a\0b", "file") == "'a\\x00b' is not a usable path (it contains a NUL byte)"
    assert "is not a usable path" in (path_problem("/" + "x" * 5000, "file") or "")


def test_resolve_paths_resolves_a_workflows_files_in_a_copy(tmp_path: Path) -> None:
    doc = {
        "name": "wf",
        "tokenizer": "tok.json",
        "model": {"pretrained": "/models/m"},
        "phases": [{"name": "p", "data": [{"path": "a.jsonl", "weight": 2}]}],
        "evals": [{"task": "qa_reasoning", "data": "e.jsonl"}],
    }
    out = resolve_paths(doc, tmp_path)
    assert out["tokenizer"] == str(tmp_path / "tok.json")
    assert out["model"]["pretrained"] == "/models/m"
    assert out["phases"][0]["data"][0] == {"path": str(tmp_path / "a.jsonl"), "weight": 2}
    assert out["evals"][0]["data"] == str(tmp_path / "e.jsonl")
    assert doc["tokenizer"] == "tok.json", "the input document is not modified"
