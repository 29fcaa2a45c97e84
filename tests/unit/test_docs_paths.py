"""Every file the README and docs/ name under examples/ exists, and so does every `../data/...`
path of a workflow snippet in them (relative to examples/workflows/, as a shipped workflow's
are): a renamed example cannot leave a doc pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path ends at the first character no file name of ours has; a trailing dot or comma is prose.
EXAMPLE_PATH = re.compile(r"examples/[\w./*-]*[\w*]")
WORKFLOW_PATH = re.compile(r'"(\.\./[\w./-]+)"')


def named_paths() -> list[tuple[str, Path]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for name in sorted(set(EXAMPLE_PATH.findall(text))):
            found.append((f"{doc.name}: {name}", ROOT / name))
        for name in sorted(set(WORKFLOW_PATH.findall(text))):
            found.append((f"{doc.name}: {name}", ROOT / "examples" / "workflows" / name))
    return found


def test_the_docs_name_example_files_that_exist() -> None:
    paths = named_paths()
    assert len(paths) > 10  # the patterns still find what the docs name
    missing = [
        where
        for where, path in paths
        if not (any(path.parent.glob(path.name)) if "*" in path.name else path.exists())
    ]
    assert missing == []
