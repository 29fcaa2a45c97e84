"""Content digests of a run's inputs. The service only hashes files; it never reads them.

Hashing a corpus takes seconds per GiB, so digests are cached in-process by (path, size,
mtime_ns) of every file involved: resubmitting a workflow over unchanged files costs stats.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from contracts.signature import Digests, sha256_path
from contracts.workflow import Workflow as WorkflowSpec
from service.errors import ApiError

_CACHE_SIZE = 4096
_cache: OrderedDict[tuple[object, ...], str] = OrderedDict()
_lock = threading.Lock()


def _fingerprint(path: Path) -> tuple[object, ...]:
    """Identity of a file's or directory's bytes, short of reading them."""
    if path.is_file():
        st = path.stat()
        return (str(path), st.st_size, st.st_mtime_ns)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return (
        str(path),
        tuple(
            (p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files
        ),
    )


def digest_path(path: Path | str) -> str:
    """contracts.signature.sha256_path, cached by (path, size, mtime_ns)."""
    path = Path(path)
    key = _fingerprint(path)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    digest = sha256_path(path)
    with _lock:
        _cache[key] = digest
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return digest


def clear_digest_cache() -> None:
    with _lock:
        _cache.clear()


def resolve_digests(workflow: WorkflowSpec, *, initial_checkpoint: str | None) -> Digests:
    """Digests of every external input; 422 `missing_input` naming each one that is gone."""
    problems: list[dict[str, str]] = []

    def digest(field: str, path: str) -> str:
        try:
            return digest_path(path)
        except (OSError, ValueError) as err:  # gone, unreadable, a NUL byte, a name too long
            problems.append({"path": field, "message": f"cannot read {path}: {err}"})
            return ""

    tokenizer = digest("tokenizer", workflow.tokenizer)
    data = {path: digest(f'data["{path}"]', path) for path in workflow.data_paths()}
    pretrained = (
        None
        if workflow.model.pretrained is None
        else digest("model.pretrained", workflow.model.pretrained)
    )
    checkpoint = (
        None if initial_checkpoint is None else digest("initial_checkpoint", initial_checkpoint)
    )
    if problems:
        raise ApiError(
            422,
            "missing_input",
            "cannot hash the run's inputs: "
            + "; ".join(f"{p['path']}: {p['message']}" for p in problems)
            + "; check that the service can read these paths (relative paths resolve against "
            "TRAINCTL_DATA_ROOT)",
            problems,
        )
    return Digests(
        tokenizer=tokenizer, data=data, initial_checkpoint=checkpoint, pretrained=pretrained
    )
