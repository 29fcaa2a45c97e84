"""The walls between the packages (docs/architecture.md), checked on the source of every module,
imports inside functions included: a lazy import crosses a wall as surely as a top-level one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What `contracts` may import besides itself and the standard library.
CONTRACTS_ALLOWED = {"pydantic", "pydantic_core", "annotated_types", "typing_extensions"}
FORBIDDEN = {
    # Both sides may import runtime; it may import neither, nor what only one side carries.
    "runtime": {"service", "worker", "cli", "torch", "sqlalchemy", "fastapi", "transformers"},
    "service": {"worker", "torch", "transformers", "safetensors", "tokenizers"},
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
    "train": {"checkpoint", "data", "link", "model"},
    "process": {"checkpoint", "data", "link", "model", "train"},
}


def imported_roots(package: Path) -> dict[str, set[str]]:
    """{top-level module name: files of `package` that import it}; relative imports stay
    inside the package and are left out."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
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
