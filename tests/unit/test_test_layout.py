"""Rules of the test tree that a partial run cannot see. Every directory's conftest.py is
imported under the one module name `conftest`, so in a run of the whole suite (`make test`) a
test module's runtime `from conftest import X` gets whichever conftest pytest loaded first:
tests/integration passes alone and fails to collect beside tests/unit. Names from a conftest
are for annotations only (under TYPE_CHECKING); values come in as fixtures."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def runtime_conftest_imports(path: Path) -> list[int]:
    """Line numbers of `import conftest` / `from conftest import ...` outside an
    `if TYPE_CHECKING:` block."""
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            guarded |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        from_conftest = isinstance(node, ast.ImportFrom) and node.module == "conftest"
        if from_conftest or (
            isinstance(node, ast.Import) and any(a.name == "conftest" for a in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_no_test_module_imports_a_conftest_at_runtime() -> None:
    found = {
        str(path.relative_to(TESTS)): lines
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "conftest.py" and (lines := runtime_conftest_imports(path))
    }
    assert found == {}


def test_the_check_sees_a_runtime_import_and_passes_a_guarded_one(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from conftest import Api\n"
        "from conftest import REDIS_URL\n"
        "def f():\n"
        "    import conftest\n"
    )
    assert runtime_conftest_imports(module) == [4, 6]
