"""The references in docs/reference/ are what scripts/reference.py generates from the code now:
a field, setting or flag changed without `make reference` fails here. And what they are made of
is complete: every setting the code names is in the table, and nothing is left without its
description or help."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("contracts", "runtime", "service", "worker", "cli")


def load_generator() -> ModuleType:
    """scripts/reference.py, which is a script and not a package, imported by its path."""
    spec = importlib.util.spec_from_file_location("reference", ROOT / "scripts" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("reference", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return load_generator()


def stale(rendered: dict[Path, str]) -> list[str]:
    """The files among `rendered` whose committed text differs from it (or that are missing)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path, text in rendered.items()
        if not path.is_file() or path.read_text() != text
    )


def test_the_committed_references_are_what_the_code_generates(reference: ModuleType) -> None:
    differ = stale(reference.render())
    assert not differ, (
        f"{', '.join(differ)} differ from what the code generates: run `make reference` "
        "and commit the result"
    )


def test_the_drift_check_sees_an_edited_and_a_missing_file(reference: ModuleType) -> None:
    rendered = reference.render()
    workflow = reference.REFERENCE / "workflow.md"
    changed = {workflow: rendered[workflow] + "\n| `new_field` | string | required | |\n"}
    missing = {reference.REFERENCE / "gone.md": "text"}
    assert stale(changed) == ["docs/reference/workflow.md"]
    assert stale(missing) == ["docs/reference/gone.md"]


def test_the_output_is_the_same_from_any_working_directory(
    reference: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = reference.render()
    monkeypatch.chdir(tmp_path)
    assert reference.render() == here
    text = "\n".join(here.values())
    assert str(ROOT) not in text and str(Path.home()) not in text and str(tmp_path) not in text


def test_every_setting_the_code_names_is_in_the_table(reference: ModuleType) -> None:
    named = {
        match
        for package in SOURCES
        for path in (ROOT / package).rglob("*.py")
        for match in re.findall(r"\bTRAINCTL_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    table = set(re.findall(r"^\| `(TRAINCTL_\w+)`", reference.settings_reference(), re.M))
    assert named - table == set()


def test_every_field_setting_and_flag_is_described(reference: ModuleType) -> None:
    import typer

    schema = reference.Workflow.model_json_schema()
    models = {"Workflow": schema, **schema["$defs"]}
    bare = [
        f"{model}.{field}"
        for model, body in models.items()
        for field, prop in body["properties"].items()
        if not prop.get("description")
    ]
    bare += [
        f"{side}: {field}"
        for side, settings in reference.SIDES.items()
        for field, info in settings.model_fields.items()
        if not info.description
    ]
    for path, command in reference.commands(["trainctl"], typer.main.get_command(reference.app)):
        bare += [f"{' '.join(path)} {p.name}" for p in command.params if not p.help]
        bare += [" ".join(path)] if not command.help else []
    assert bare == []
