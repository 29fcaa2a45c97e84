"""User-given paths, read on the machine that opens them: one resolution and one check for
workflows, runs' initial checkpoints and jobs, in the service and in the CLI.

A relative path resolves against a base folder (the service's `TRAINCTL_DATA_ROOT`, or the
folder of the workflow file the CLI reads) and `~` is the reading process's home. An absolute
path is kept as written: workflow paths are part of a run's signature, so the same document
must read the same after a symlink moves. An object store URI (`s3://bucket/key`) is kept as
written too, and is not looked at here: whether an object or a prefix is there is found when
it is hashed (the service's HEAD or listing), which the data roots confine first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contracts.bounds import EMPTY_PATH
from contracts.paths import is_uri
from contracts.workflow import (
    PathKind,
    Problem,
    Workflow,
    WorkflowInvalid,
    json_path,
    path_fields,
    replace_paths,
    validate_workflow,
)


def resolve_path(value: str, base: Path) -> str:
    """`value` made absolute: `~` expanded, a relative path joined to `base` and resolved. A
    path the OS cannot use (a NUL byte, a name too long) is kept as given; `path_problem`
    says why when it is checked."""
    if not value or is_uri(value):
        return value
    try:
        path = Path(value).expanduser()
        if path.is_absolute():
            return str(path) if value.startswith("~") else value
        return str((base / path).resolve())
    except (OSError, ValueError, RuntimeError):  # RuntimeError: `~user` with no such user
        return value


def path_problem(path: str, kind: PathKind) -> str | None:
    """Why `path` is not an existing `kind` ("file": a regular file, "directory", or "path":
    either), or None."""
    if not path:
        return EMPTY_PATH
    if "\0" in path:
        return f"{path[:200]!r} is not a usable path (it contains a NUL byte)"
    if is_uri(path):
        return None  # an object or a prefix: found (or not) when it is hashed, by its store
    try:
        target = Path(path)
        if not target.exists():
            return f"{'file' if kind == 'path' else kind} {path} not found"
        if kind == "file" and not target.is_file():
            return f"{path} is not a regular file"
        if kind == "directory" and not target.is_dir():
            return f"{path} is not a directory"
    except (OSError, ValueError) as err:  # a name too long, a path the OS refuses
        return f"{path[:200]!r} is not a usable path ({err})"
    return None


def resolve_paths(doc: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of a raw workflow document with each file it names resolved (`resolve_path`)."""
    return replace_paths(doc, lambda value: resolve_path(value, base))


def workflow_path_problems(doc: Any) -> list[Problem]:
    """Each file a raw workflow document names that is missing, unusable or of the wrong
    kind, at its JSON path."""
    if not isinstance(doc, dict):
        return []
    return [
        Problem(path=json_path(loc), message=why)
        for loc, value, kind in path_fields(doc)
        # An empty one is the schema's problem (contracts.bounds.UserPath), named once.
        if value and (why := path_problem(value, kind))
    ]


def validate_workflow_with_files(doc: Any) -> Workflow:
    """`validate_workflow`, and the files the (resolved) document names checked here; raises
    `WorkflowInvalid` listing every problem, in the document and on disk, at once."""
    on_disk = workflow_path_problems(doc)
    try:
        workflow = validate_workflow(doc)
    except WorkflowInvalid as err:
        raise WorkflowInvalid(err.problems + on_disk) from None
    if on_disk:
        raise WorkflowInvalid(on_disk)
    return workflow
