"""Writes the three references in docs/reference/ from the code, so that they cannot drift from
it: workflow.md from the workflow's pydantic models, settings.md from the settings classes of
the service, the worker and the CLI, and cli.md from the `trainctl` typer app.

`make reference` runs it (`PYTHONPATH=. python scripts/reference.py`); the unit test
tests/unit/test_reference_docs.py renders the three in memory and fails when the committed
files differ. The output is the same on every machine: no absolute paths, no home directory
(a default that depends on the environment is written as the expression it comes from).
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from cli.config import CliSettings
from cli.main import app
from contracts.workflow.schema import Workflow
from service.settings import ServiceSettings
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
GENERATED = "<!-- Generated from the code by `make reference` (scripts/reference.py). -->"


def cell(text: str) -> str:
    """`text` as one Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def paragraph(text: str | None) -> str:
    """A docstring or help text as Markdown paragraphs: its lines joined, blank lines kept."""
    blocks = (text or "").strip().split("\n\n")
    return "\n\n".join(" ".join(block.split()) for block in blocks if block.strip())


def anchor(model: str) -> str:
    return model.lower()


# ---------------------------------------------------------------- types and limits (JSON Schema)


def ref_name(prop: dict[str, Any]) -> str | None:
    ref = prop.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def schema_type(prop: dict[str, Any]) -> str:
    """A JSON Schema property as a short type: `integer`, `list of Phase`, `"a" or "b"`."""
    if name := ref_name(prop):
        return f"[{name}](#{anchor(name)})"
    if "anyOf" in prop:
        return " or ".join(schema_type(branch) for branch in prop["anyOf"])
    if "enum" in prop:
        return " or ".join(f"`{json.dumps(value)}`" for value in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(schema_type(p) for p in prop["prefixItems"]) + "]"
        return f"list of {schema_type(prop.get('items', {}))}"
    if kind == "string" and prop.get("format") == "path":
        return "path"
    return str(kind or "any")


def schema_limits(prop: dict[str, Any]) -> list[str]:
    """The limits JSON Schema states for a property (of its non-null branch, for an optional
    one): bounds, lengths, item counts, patterns."""
    limits = []
    for key, text in (
        ("minimum", "≥ {}"),
        ("exclusiveMinimum", "> {}"),
        ("maximum", "≤ {}"),
        ("exclusiveMaximum", "< {}"),
        ("minLength", "length ≥ {}"),
        ("maxLength", "length ≤ {}"),
        ("minItems", "items ≥ {}"),
        ("maxItems", "items ≤ {}"),
        ("pattern", "matches `{}`"),
    ):
        if key in prop:
            limits.append(text.format(prop[key]))
    for branch in prop.get("anyOf", []):
        limits += schema_limits(branch)
    return limits


def typed(prop: dict[str, Any]) -> str:
    limits = schema_limits(prop)
    return schema_type(prop) + (f" ({', '.join(limits)})" if limits else "")


# ---------------------------------------------------------------- workflow.md


def model_refs(prop: dict[str, Any], suffix: str = "") -> Iterator[tuple[str, str]]:
    """(model, path suffix) for each model a property holds: `[]` marks a list's items."""
    if name := ref_name(prop):
        yield name, suffix
    for branch in prop.get("anyOf", []):
        yield from model_refs(branch, suffix)
    if prop.get("type") == "array" and "items" in prop:
        yield from model_refs(prop["items"], suffix + "[]")


def workflow_reference() -> str:
    schema = Workflow.model_json_schema()
    models = {"Workflow": schema, **schema.get("$defs", {})}
    order: list[str] = []
    places: dict[str, list[str]] = {}

    def visit(name: str, path: str) -> None:
        places.setdefault(name, []).append(path)
        if name in order:
            return
        order.append(name)
        for field, prop in models[name].get("properties", {}).items():
            for child, suffix in model_refs(prop):
                visit(child, f"{path}.{field}{suffix}" if path else f"{field}{suffix}")

    visit("Workflow", "")
    lines = [
        "# The workflow document",
        "",
        GENERATED,
        "",
        "A workflow is one JSON document (`POST /workflows`, `POST /runs`, "
        "`trainctl workflow validate`). This page lists every field with its type, default, "
        "limits and meaning, from the pydantic models in `contracts/workflow/schema.py`. A "
        "field without a default is required; a field not listed is refused. Rules between "
        "fields (the token envelope of every phase and source, unique names, eval sets named "
        "by `keep_best`) are checked by `contracts/workflow/validation.py`, and every problem "
        "is reported at once with its JSON path.",
        "",
    ]
    for name in order:
        model = models[name]
        where = ", ".join(f"`{p}`" if p else "the document" for p in places[name])
        lines += [f"## {name}", "", f"At: {where}.", ""]
        if description := model.get("description"):
            lines += [paragraph(description), ""]
        lines += ["| Field | Type | Default | Description |", "|---|---|---|---|"]
        required = set(model.get("required", []))
        for field, prop in model.get("properties", {}).items():
            if field in required:
                default = "required"
            elif "default" in prop and isinstance(prop["default"], dict):
                default = "its fields' defaults"
            elif "default" in prop:
                default = f"`{json.dumps(prop['default'])}`"
            else:
                default = "optional"
            text = prop.get("description", "")
            lines.append(f"| `{field}` | {cell(typed(prop))} | {default} | {cell(text)} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- settings.md

# A stand-in home, so that the defaults derived from it read as `$TRAINCTL_HOME/...`.
_HOME = Path("/trainctl-reference-home")


def defaults_of(settings: type[BaseSettings]) -> BaseSettings:
    """`settings` built from its defaults alone (no environment, no .env) with home at a
    stand-in, so that the derived defaults are computed by the code itself."""

    class Defaults(settings):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            *sources: PydanticBaseSettingsSource,
            **named: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings,)

    return Defaults(home=_HOME)


def environment_free(value: Any) -> str:
    """A default as text, with this machine's paths written as the expressions they come
    from: the stand-in home as `$TRAINCTL_HOME`, the working directory as `$PWD`, the user's
    home as `~`."""
    if isinstance(value, str) and value.startswith("/"):
        value = Path(value)  # a folder kept as text (it may be a URI too)
    if not isinstance(value, Path):
        return str(value).replace(str(_HOME), "$TRAINCTL_HOME")
    if value == Path.cwd():  # exactly: the working directory may lie anywhere, "/" included
        return "$PWD"
    for base, expression in ((_HOME, "$TRAINCTL_HOME"), (Path.home(), "~")):
        if value.is_relative_to(base):
            return "/".join((expression, *value.relative_to(base).parts))
    return str(value)


def setting_value(value: Any) -> str:
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, tuple):
        text = os.pathsep.join(environment_free(v) for v in value)
    else:
        text = environment_free(value)
    return f"`{text}`" if text else "empty"


SIDES: dict[str, type[BaseSettings]] = {
    "cli": CliSettings,
    "service": ServiceSettings,
    "worker": WorkerSettings,
}


def settings_reference() -> str:
    rows: dict[str, list[tuple[str, str, str, str]]] = {}
    for side, settings in SIDES.items():
        prefix = settings.model_config.get("env_prefix", "")
        schema = settings.model_json_schema()["properties"]
        built = defaults_of(settings)
        for field, info in settings.model_fields.items():
            if field == "home":
                default = setting_value(info.default)
            else:
                default = setting_value(getattr(built, field))
            row = (typed(schema[field]), default, info.description or "")
            variable = f"{prefix}{field}".upper()
            for i, (sides, *same) in enumerate(rows.get(variable, [])):
                if tuple(same) == row:  # one line for the sides that read it alike
                    rows[variable][i] = (f"{sides}, {side}", *row)
                    break
            else:
                rows.setdefault(variable, []).append((side, *row))
    lines = [
        "# Settings",
        "",
        GENERATED,
        "",
        "Every setting is an environment variable prefixed `TRAINCTL_`, read once per process "
        "by the side that needs it: `cli` (every `trainctl` command that talks to the API, "
        "`cli/config.py`), `service` (`trainctl serve` and `up`, `service/settings.py`) and "
        "`worker` (`trainctl worker` and the workers `up` starts, `worker/settings.py`). A "
        "variable that two sides read alike is one row. `$TRAINCTL_HOME` stands for the home "
        "setting's value and `$PWD` for the working directory the process started in. "
        "`trainctl up` hands its workers its own home, API address, broker, queue and a "
        "worker token of its own.",
        "",
        "| Variable | Read by | Type | Default | Description |",
        "|---|---|---|---|---|",
    ]
    for variable in sorted(rows):
        for sides, kind, default, description in rows[variable]:
            lines.append(
                f"| `{variable}` | {sides} | {cell(kind)} | {cell(default)} | {cell(description)} |"
            )
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- cli.md


def param_type(param: Any) -> str:
    """From the click parameter type every typer version builds (by class name: some typer
    versions carry a click of their own), not from typer's internals."""
    kind_of = param.type
    classes = {cls.__name__ for cls in type(kind_of).__mro__}
    if classes & {"Choice", "TyperChoice"}:
        kind = " or ".join(f"`{getattr(c, 'value', c)}`" for c in kind_of.choices)
    elif getattr(param, "is_flag", False) or "BoolParamType" in classes:
        kind = "flag"
    elif "IntParamType" in classes:
        kind = "integer"
    elif "FloatParamType" in classes:
        kind = "number"
    elif classes & {"Path", "TyperPath"}:
        kind = "path"
    else:
        kind = "text"
    low, high = getattr(kind_of, "min", None), getattr(kind_of, "max", None)
    bounds = [f"≥ {low}"] if low is not None else []
    bounds += [f"≤ {high}"] if high is not None else []
    kind += f" ({', '.join(bounds)})" if bounds else ""
    repeated = getattr(param, "multiple", False) or param.nargs == -1
    return kind + (", repeatable" if repeated else "")


def param_default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if value is None or (isinstance(value, list | tuple) and not value):
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path) and value.is_relative_to(ROOT):
        return f"`{value.relative_to(ROOT)}` (in the source tree)"
    return f"`{environment_free(value)}`"


def usage(path: list[str], command: Any) -> str:
    pieces = [*path]
    params = [p for p in command.params if not p.hidden]
    if any(p.param_type_name == "option" for p in params):
        pieces.append("[OPTIONS]")
    for param in params:
        if param.param_type_name == "argument":
            name = param.name.upper() + ("..." if param.nargs == -1 else "")
            pieces.append(name if param.required else f"[{name}]")
    if hasattr(command, "commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def commands(path: list[str], command: Any) -> Iterator[tuple[list[str], Any]]:
    """Every command under `command`, itself first, subcommands sorted by name."""
    yield path, command
    for name in sorted(getattr(command, "commands", {})):
        sub = command.commands[name]
        if not sub.hidden:
            yield from commands([*path, name], sub)


def cli_reference() -> str:
    root = typer.main.get_command(app)
    lines = [
        "# The `trainctl` command",
        "",
        GENERATED,
        "",
        "Every command and flag of `trainctl`, from the typer app in `cli/main.py`; "
        "`trainctl COMMAND --help` prints the same. Exit codes: 0 success, 1 the thing asked "
        "for failed, 2 bad input, 3 the service could not be reached or answered an error.",
        "",
    ]
    for path, command in commands(["trainctl"], root):
        lines += [f"{'#' * min(len(path) + 1, 4)} `{' '.join(path)}`", ""]
        lines += [f"    {usage(path, command)}", ""]
        if command.help:
            lines += [paragraph(command.help), ""]
        params = [p for p in command.params if not p.hidden]
        if params:
            lines += ["| Argument or option | Type | Default | Help |", "|---|---|---|---|"]
            for param in params:
                if param.param_type_name == "argument":
                    name = param.name.upper()
                else:
                    name = ", ".join([*param.opts, *param.secondary_opts])
                lines.append(
                    f"| `{name}` | {cell(param_type(param))} | {cell(param_default(param))} | "
                    f"{cell(param.help or '')} |"
                )
            lines.append("")
        if hasattr(command, "commands"):
            subs = ", ".join(f"`{name}`" for name in sorted(command.commands))
            lines += [f"Commands: {subs}.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the files


def render() -> dict[Path, str]:
    """{file under docs/reference: its content as the code generates it now}."""
    return {
        REFERENCE / "workflow.md": workflow_reference(),
        REFERENCE / "settings.md": settings_reference(),
        REFERENCE / "cli.md": cli_reference(),
    }


def main() -> int:
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for path, text in render().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
