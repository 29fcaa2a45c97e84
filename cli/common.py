"""What every command shares: consoles, exit codes, the API call and error printing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from cli.config import get_settings
from client import ApiError, Client

if TYPE_CHECKING:
    from contracts.workflow import WorkflowInvalid

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_API = 1, 2, 3

console = Console()
err_console = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")]
RunId = Annotated[str, typer.Argument(help="The run's id (run_...), as `runs list` shows it.")]


T = TypeVar("T")


def client() -> Client:
    settings = get_settings()
    return Client(settings.api_url, settings.resolved_token())


def fail(message: str, code: int) -> typer.Exit:
    # Escaped: messages quote user input and codes in brackets, which are not markup.
    err_console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    return typer.Exit(code)


def refuse_workflow(path: Path, err: WorkflowInvalid) -> typer.Exit:
    """Print every problem of the workflow file at `path`, one a line; the exit (2) to raise."""
    for problem in err.problems:
        err_console.print(f"[red]{path}[/red] {problem.path}: {problem.message}")
    return typer.Exit(EXIT_BAD_INPUT)


def call(action: Callable[[Client], T]) -> T:
    """`action` on a client of the configured API; an error answer is printed, exit 3."""
    try:
        with client() as api:
            return action(api)
    except ApiError as err:
        detail = f"\n{json.dumps(err.details, indent=2)}" if err.details else ""
        raise fail(f"{err.message} [{err.code}]{detail}", EXIT_API) from err


def jsonable(answer: BaseModel | dict[str, Any]) -> dict[str, Any]:
    """An answer as the API wrote it: a model back to its JSON form."""
    return answer.model_dump(mode="json") if isinstance(answer, BaseModel) else answer


def print_json(answer: BaseModel | dict[str, Any]) -> None:
    print(json.dumps(jsonable(answer), indent=2))


def load_workflow(path: Path) -> dict[str, Any]:
    """Read a workflow file (client.read_workflow: relative paths resolved against the file's
    own folder); what cannot be read is bad input, named with the file."""
    from client.client import read_workflow

    try:
        return read_workflow(path)
    except FileNotFoundError as err:
        raise fail(f"workflow file {path} not found", EXIT_BAD_INPUT) from err
    except json.JSONDecodeError as err:
        raise fail(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}", 2) from err
    except (OSError, UnicodeDecodeError) as err:
        raise fail(f"workflow file {path} cannot be read: {err}", EXIT_BAD_INPUT) from err
    except ValueError as err:  # not a JSON object
        raise fail(str(err), EXIT_BAD_INPUT) from err
