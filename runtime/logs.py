"""Log lines both sides write the same way: text or JSON, with the run and attempt they are about.

Standard library only. `log_context(run_id=..., attempt_id=...)` tags every line logged inside it
(by any logger) with those ids; a worker process trains one attempt at a time, so it tags the
whole process (`process_wide=True`), which also covers its background threads (checkpoint
writer, heartbeats). `configure_logging("json")` writes one JSON object per line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

LogFormat = Literal["text", "json"]
_FIELDS = ("run_id", "attempt_id")

_context: ContextVar[dict[str, str] | None] = ContextVar("trainctl_log_context", default=None)
_process: dict[str, str] = {}


@contextmanager
def log_context(*, process_wide: bool = False, **ids: str | None) -> Iterator[None]:
    """Tag log lines inside the block with `ids` (run_id, attempt_id)."""
    values = {k: v for k, v in ids.items() if v is not None}
    if process_wide:
        before = dict(_process)
        _process.update(values)
        try:
            yield
        finally:
            _process.clear()
            _process.update(before)
        return
    token = _context.set({**(_context.get() or {}), **values})
    try:
        yield
    finally:
        _context.reset(token)


def current_ids() -> dict[str, str]:
    return {**_process, **(_context.get() or {})}


class ContextFilter(logging.Filter):
    """Puts run_id and attempt_id (or None) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = current_ids()
        for field in _FIELDS:
            if not hasattr(record, field):
                setattr(record, field, ids.get(field))
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in _FIELDS:
            if (value := getattr(record, field, None)) is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(ids)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        ids = [
            f"{f.split('_')[0]}={getattr(record, f)}" for f in _FIELDS if getattr(record, f, None)
        ]
        record.ids = f" [{' '.join(ids)}]" if ids else ""
        return super().format(record)


def configure_logging(fmt: LogFormat = "text", level: str = "INFO") -> None:
    """One handler on the root logger, to stderr, in `fmt`; replaces any handlers there."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
