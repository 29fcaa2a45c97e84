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
# What the client (client/) may import besides itself, contracts, runtime and the standard
# library: it is installed and imported on its own, without a side, torch or the CLI.
CLIENT_ALLOWED = {"contracts", "runtime", "httpx", "pydantic", "pydantic_core"}
FORBIDDEN = {
    # Both sides may import runtime; it may import neither, nor what only one side carries.
    "runtime": {"service", "worker", "cli", "torch", "sqlalchemy", "fastapi", "transformers"},
    # migrations/env.py imports service; service finds the migrations folder without importing it.
    "service": {"worker", "torch", "transformers", "safetensors", "tokenizers", "migrations"},
    "worker": {"service", "sqlalchemy", "alembic", "fastapi"},
}
# Inside worker, arrows run one way: each subpackage imports only the ones below it (its
# __init__.py says which), and worker's shared top-level modules (settings, error, files,
# failpoint, metrics) import none.
WORKER_BELOW = {
    "data": set(),
    "model": set(),
    "link": set(),
    "checkpoint": {"data", "model"},
    "remote": {"checkpoint", "data", "model"},
    "train": {"checkpoint", "data", "link", "model", "remote"},
    "process": {"checkpoint", "data", "link", "model", "remote", "train"},
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

# service/'s layers (docs/architecture.md): its top-level modules are the foundation, which
# imports none of its subpackages; each subpackage may import what is named here, and itself.
SERVICE_LAYERS: dict[str, set[str]] = {
    "service": set(),
    "service.checkpoints": {"service"},
    "service.workers": {"service", "service.checkpoints"},
    "service.runs": {"service", "service.checkpoints", "service.workers"},
    # The read models never import the workers' side (the dispatcher, leases, the reaper).
    "service.reads": {"service", "service.runs"},
    "service.api": {
        "service",
        "service.checkpoints",
        "service.workers",
        "service.runs",
        "service.reads",
    },
}
# migrations/env.py builds on the foundation only (the engine, the models, the settings).
MIGRATIONS_MAY_IMPORT = {"service"}


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


def worker_subpackages_imported(paths: list[Path], root: Path) -> dict[str, set[str]]:
    """{worker subpackage: files among `paths` that import it}, lazy imports included."""
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[0] == "worker" and parts[1] in WORKER_BELOW:
                    found.setdefault(parts[1], set()).add(str(path.relative_to(root)))
    return found


def client_violations(package: Path) -> dict[str, set[str]]:
    allowed = set(sys.stdlib_module_names) | CLIENT_ALLOWED | {"client", "__future__"}
    return {m: files for m, files in imported_roots(package).items() if m not in allowed}


def contracts_violations(package: Path) -> dict[str, set[str]]:
    allowed = set(sys.stdlib_module_names) | CONTRACTS_ALLOWED | {"contracts", "__future__"}
    return {m: files for m, files in imported_roots(package).items() if m not in allowed}


def wall_violations(package: Path, forbidden: set[str]) -> dict[str, set[str]]:
    return {m: files for m, files in imported_roots(package).items() if m in forbidden}


def test_contracts_import_only_pydantic_and_the_standard_library() -> None:
    assert contracts_violations(ROOT / "contracts") == {}


def test_the_client_imports_only_contracts_runtime_httpx_and_pydantic() -> None:
    assert client_violations(ROOT / "client") == {}


def test_the_client_check_sees_a_side_imported_lazily(tmp_path: Path) -> None:
    (tmp_path / "client.py").write_text(
        "import httpx\nfrom contracts.api import RunPublic\ndef later():\n    import torch\n"
        "    from service.api.app import create_app\n    from cli.common import call\n"
    )
    assert client_violations(tmp_path) == {
        "torch": {"client.py"},
        "service": {"client.py"},
        "cli": {"client.py"},
    }


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


def test_every_worker_subpackage_has_its_place_among_the_arrows() -> None:
    folders = {p.name for p in (ROOT / "worker").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(WORKER_BELOW)


@pytest.mark.parametrize("subpackage", sorted(WORKER_BELOW))
def test_a_worker_subpackage_imports_only_the_ones_below_it(subpackage: str) -> None:
    package = ROOT / "worker" / subpackage
    found = worker_subpackages_imported(sorted(package.rglob("*.py")), ROOT)
    allowed = WORKER_BELOW[subpackage] | {subpackage}
    assert {name: files for name, files in found.items() if name not in allowed} == {}


def test_the_shared_worker_modules_import_no_worker_subpackage() -> None:
    assert worker_subpackages_imported(sorted((ROOT / "worker").glob("*.py")), ROOT) == {}


def test_the_worker_arrows_see_lazy_imports_and_module_imports(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(
        "from worker.data.batch import Batch\n"
        "from worker import settings\n"
        "def later():\n"
        "    from worker.process import runner\n"
        "    import worker.link.client\n"
    )
    assert worker_subpackages_imported([tmp_path / "loop.py"], tmp_path) == {
        "data": {"loop.py"},
        "process": {"loop.py"},
        "link": {"loop.py"},
    }


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


def layer_of(module: str) -> str:
    """The layer of service a dotted name lies in: its subpackage, or `service` (the
    foundation); outside service, its top-level package."""
    top = module.split(".")[0]
    package = ".".join(module.split(".")[:2])
    return package if package in SERVICE_LAYERS else top


def service_layers_imported(path: Path) -> set[str]:
    """The layers of service that the module at `path` imports, lazily or not."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            # `from service import access`, `from service.api import observability`
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return {layer_of(n) for n in names if n == "service" or n.startswith("service.")}


def layer_violations(root: Path, package: str, allowed: dict[str, set[str]]) -> dict[str, set[str]]:
    """{file of `package` under `root`: the layers of service it imports that its own layer
    (`layer_of`) may not}; a file's own layer is always allowed."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        own = layer_of(".".join(path.relative_to(root).with_suffix("").parts))
        refused = service_layers_imported(path) - allowed.get(own, set()) - {own}
        if refused:
            found[str(path.relative_to(root))] = refused
    return found


def test_service_layers_import_only_the_layers_below() -> None:
    assert layer_violations(ROOT, "service", SERVICE_LAYERS) == {}


def test_migrations_import_only_the_service_foundation() -> None:
    assert layer_violations(ROOT, "migrations", {"migrations": MIGRATIONS_MAY_IMPORT}) == {}


def test_the_layer_check_sees_lazy_imports_and_from_imports_of_a_layer(tmp_path: Path) -> None:
    (tmp_path / "service" / "reads").mkdir(parents=True)
    (tmp_path / "service" / "reads" / "series.py").write_text(
        "from service import models\n"
        "from service.runs.view import run_tags\n"
        "def send():\n"
        "    from service.workers import dispatch\n"
    )
    (tmp_path / "service" / "lifecycle.py").write_text("from service.api import app\n")
    assert layer_violations(tmp_path, "service", SERVICE_LAYERS) == {
        "service/lifecycle.py": {"service.api"},
        "service/reads/series.py": {"service.workers"},
    }
