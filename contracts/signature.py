"""Run identity: the signature is computed here and nowhere else.

signature = SHA-256 of the canonical JSON (sorted keys, no whitespace) of the components:
the normalised workflow plus the SHA-256 digests of the initial checkpoint (or null), the
pretrained model directory (or null), the tokenizer and every data file. The components are
stored beside the signature so that a later mismatch can be explained field by field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from contracts.workflow import ENCODER_VERSION, Workflow, defaults_written_out

_CHUNK = 1 << 20


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_file(path: Path | str, progress: Callable[[], None] | None = None) -> str:
    """A file's SHA-256; `progress` is called after each chunk (1 MiB) read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress()
    return digest.hexdigest()


def sha256_path(path: Path | str, progress: Callable[[], None] | None = None) -> str:
    """A file's SHA-256, or for a directory `sha256_listing` of its files (so renaming a file
    inside changes it too). `progress` is called after each chunk (1 MiB) read: a worker
    hashing many GiB says it is not hung."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path, progress)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    files = [p for p in path.rglob("*") if p.is_file()]
    return sha256_listing(
        (p.relative_to(path).as_posix(), sha256_file(p, progress)) for p in sorted(files)
    )


def sha256_listing(files: Iterable[tuple[str, str]]) -> str:
    """The digest of a directory from its files' (relative path, SHA-256): the SHA-256 over
    their `relative-path NUL file-sha256 LF` lines, ordered by path part by part ("a/x"
    before "a-b/x", as paths compare). The one rule for a folder, a prefix of objects and a
    checkpoint known by its manifest alone."""
    digest = hashlib.sha256()
    for rel, sha in sorted(files, key=lambda item: item[0].split("/")):
        digest.update(f"{rel}\0{sha}\n".encode())
    return digest.hexdigest()


class Digests(BaseModel):
    """Every external input of a run, by content."""

    tokenizer: str
    data: dict[str, str]
    initial_checkpoint: str | None = None
    pretrained: str | None = None


class Signature(BaseModel):
    sha256: str
    components: dict[str, Any]


def signature_components(
    *, workflow: Workflow, digests: Digests, initial_checkpoint: str | None = None
) -> dict[str, Any]:
    return {
        "encoder_version": ENCODER_VERSION,
        "workflow": workflow.signed(),
        "initial_checkpoint": (
            None
            if digests.initial_checkpoint is None
            else {"path": initial_checkpoint, "sha256": digests.initial_checkpoint}
        ),
        "pretrained": None if digests.pretrained is None else {"sha256": digests.pretrained},
        "tokenizer": {"sha256": digests.tokenizer},
        "data": {path: {"sha256": sha} for path, sha in sorted(digests.data.items())},
    }


def compute_signature(
    *, workflow: Workflow, digests: Digests, initial_checkpoint: str | None = None
) -> Signature:
    components = signature_components(
        workflow=workflow, digests=digests, initial_checkpoint=initial_checkpoint
    )
    # The initial checkpoint's identity is its content, not where it lies: a moved file
    # resumes fine, a changed one does not.
    hashed = {
        **components,
        "initial_checkpoint": (
            None
            if components["initial_checkpoint"] is None
            else {"sha256": components["initial_checkpoint"]["sha256"]}
        ),
    }
    return Signature(
        sha256=hashlib.sha256(canonical_json(hashed).encode()).hexdigest(),
        components=components,
    )


class FieldDiff(BaseModel):
    field: str
    stored: Any
    given: Any


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            # Data files are keyed by path; quote it so the field reads data["/a/b.jsonl"].
            name = (
                f'{prefix}["{key}"]'
                if prefix == "data"
                else (f"{prefix}.{key}" if prefix else str(key))
            )
            _flatten(inner, name, out)
    elif isinstance(value, list) and value:
        for i, inner in enumerate(value):
            _flatten(inner, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def diff_components(stored: dict[str, Any], given: dict[str, Any]) -> list[FieldDiff]:
    """Every leaf that differs, named as a user would write it: `phases[2].steps`,
    `initial_checkpoint.sha256`, `tokenizer.sha256`. Workflow fields drop the `workflow.`
    prefix. A path-only difference of the initial checkpoint is not a difference."""

    def leaves(components: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        comps = dict(components)
        _flatten(defaults_written_out(comps.pop("workflow", {})), "", out)
        ckpt = comps.pop("initial_checkpoint", None)
        out["initial_checkpoint.sha256"] = None if ckpt is None else ckpt.get("sha256")
        for key, value in comps.items():
            _flatten(value, key, out)
        return out

    a, b = leaves(stored), leaves(given)
    return [
        FieldDiff(field=key, stored=a.get(key), given=b.get(key))
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key)
    ]
