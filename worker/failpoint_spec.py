"""The grammar of `TRAINCTL_TEST_FAILPOINTS`: which fault (kill, slow, hang, full) at which
point and step (worker/failpoint.py says what each does). The settings parse it to refuse a typo
at start; `failpoint` parses it to arm the points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

POINTS = ("before_step", "after_step", "mid_checkpoint", "mid_upload", "after_checkpoint")
Action = Literal["kill", "slow", "hang", "full"]
_PREFIXES: tuple[tuple[str, Action], ...] = (
    ("slow_", "slow"),
    ("hang_", "hang"),
    ("full_", "full"),
)
_GRAMMAR = (
    "expected point@step, slow_point@step=seconds, hang_point@step or full_point@step, with "
    "point one of "
    f"{', '.join(POINTS)}, step a non-negative integer and seconds a number >= 0"
)


@dataclass(frozen=True)
class Armed:
    action: Action
    seconds: float = 0.0
    # The item as written, for the log line.
    spec: str = ""


def parse(spec: str) -> dict[tuple[str, int], Armed]:
    """`"mid_checkpoint@10, slow_before_step@3=6"` ->
    {("mid_checkpoint", 10): kill, ("before_step", 3): slow for 6 s}."""
    armed: dict[tuple[str, int], Armed] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        where, what = _parse_item(item)
        if where in armed:
            raise ValueError(f"failpoint {item!r}: {where[0]}@{where[1]} is armed twice")
        armed[where] = what
    return armed


def _parse_item(item: str) -> tuple[tuple[str, int], Armed]:
    bad = ValueError(f"failpoint {item!r}: {_GRAMMAR}")
    name, at, rest = item.partition("@")
    step, equals, value = rest.partition("=")
    name, step = name.strip(), step.strip()
    action: Action = "kill"
    for prefix, kind in _PREFIXES:
        if name.startswith(prefix):
            name, action = name.removeprefix(prefix), kind
    if name not in POINTS or not at or not step.isdigit() or (action == "slow") != bool(equals):
        raise bad
    seconds = 0.0
    if action == "slow":
        try:
            seconds = float(value)
        except ValueError:
            raise bad from None
        if not 0 <= seconds < math.inf:
            raise bad
    return (name, int(step)), Armed(action=action, seconds=seconds, spec=item)
