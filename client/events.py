"""Server-sent events (`GET /runs/{id}/events`) as they arrive: each a name and its JSON data.
service/api/routes/events.py says which events there are and what each one carries."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    """One event: `run`, `metrics`, `evals`, `rewind`, `end` or `error`, and its data."""

    name: str
    data: dict[str, Any]


def parse_events(lines: Iterable[str]) -> Iterator[Event]:
    """The events of a text/event-stream body, one per blank-line-terminated block; comments
    (`: ping`) are skipped, and `data:` lines of one event are joined with newlines."""
    name, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield Event(name, json.loads("\n".join(data)))
            name, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    if data:
        yield Event(name, json.loads("\n".join(data)))
