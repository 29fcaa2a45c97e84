"""The walls between the packages (docs/architecture.md), checked on the source of every module,
imports inside functions included: a lazy import crosses a wall as surely as a top-level one.
The CLI's wall is the one exception: a command may import a side, inside its own body."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What `contracts` may import besides itself and the standard library.
CONTRACTS_ALLOWED = {"pydantic", "pydantic_core", "annotated_types", "typing_extensions"}
FORBIDDEN = {
    # Both sides may import runtime; it may import neither, nor what only one side carries.
    "runtime": {"service", "worker", "cli", "torch", "sqlalchemy", "fastapi", "transformers"},
    # migrations/env.py imports service; service finds the migrations folder without importing it.
    "service": {"worker", "torch", "transformers", "safetensors", "tokenizers", "migrations"},
    "worker": {"service", "sqlalchemy", "alembic", "fastapi"},
}
# What `cli` imports only inside the command that needs it: a side, or what only a side's extra
# installs, so that `trainctl runs list` works with the base install alone.
CLI_LAZY = {
    "service",
    "worker",
    *("fastapi", "uvicorn", "sqlalchemy", "alembic", "psycopg", "sse_starlette"),
    *("torch", "transformers", "tokenizers", "safetensors", "numpy", "zstandard"),
    "prometheus_client",
}


def module_level(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes of a module outside its functions' bodies: what runs when it is imported."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_roots(package: Path, *, inside_functions: bool = True) -> dict[str, set[str]]:
    """{top-level module name: files of `package` that import it}; relative imports stay
    inside the package and are left out, and so are imports inside functions unless
    `inside_functions`."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree) if inside_functions else module_level(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(package)))
    return found


def contracts_violations(package: Path) -> dict[str, set[str]]:
    allowed = set(sys.stdlib_module_names) | CONTRACTS_ALLOWED | {"contracts", "__future__"}
    return {m: files for m, files in imported_roots(package).items() if m not in allowed}


def wall_violations(package: Path, forbidden: set[str]) -> dict[str, set[str]]:
    return {m: files for m, files in imported_roots(package).items() if m in forbidden}


def test_contracts_import_only_pydantic_and_the_standard_library() -> None:
    assert contracts_violations(ROOT / "contracts") == {}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_behind_its_wall(package: str) -> None:
    assert wall_violations(ROOT / package, FORBIDDEN[package]) == {}


def test_the_cli_imports_a_side_only_inside_the_command_that_needs_it() -> None:
    found = imported_roots(ROOT / "cli", inside_functions=False)
    assert {m: files for m, files in found.items() if m in CLI_LAZY} == {}


def test_the_checks_see_lazy_imports_and_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "dispatch.py").write_text(
        "import json\n"
        "from pydantic import BaseModel\n"
        "def options():\n"
        "    from kombu.transport import TRANSPORT_ALIASES\n"
        "    import torch.nn\n"
    )
    assert contracts_violations(tmp_path) == {"kombu": {"dispatch.py"}, "torch": {"dispatch.py"}}
    assert wall_violations(tmp_path, FORBIDDEN["runtime"]) == {"torch": {"dispatch.py"}}


def test_the_checks_see_the_modules_of_subpackages(tmp_path: Path) -> None:
    (tmp_path / "workflow").mkdir()
    (tmp_path / "workflow" / "schema.py").write_text("import torch\n")
    assert contracts_violations(tmp_path) == {"torch": {"workflow/schema.py"}}


def test_the_cli_check_sees_what_runs_at_import_and_not_in_a_command(tmp_path: Path) -> None:
    (tmp_path / "runs.py").write_text(
        "import typer\n"
        "if typer:\n"
        "    import torch\n"
        "def command():\n"
        "    from service.db import make_session_factory\n"
        "class Table:\n"
        "    from worker.store import Stores\n"
    )
    assert imported_roots(tmp_path, inside_functions=False) == {
        "typer": {"runs.py"},
        "torch": {"runs.py"},
        "worker": {"runs.py"},
    }
