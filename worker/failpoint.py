"""Fault injection: SIGKILL this process at an exact instant of the training loop.

The integration and end-to-end tests arm points with `TRAINCTL_FAILPOINTS` (comma-separated
`name@step`, e.g. `mid_checkpoint@10,after_step@3`); production leaves it empty and `hit` costs a
set lookup. SIGKILL, not an exception: nothing (no `finally`, no atexit, no flush) may run, as
when a spot instance disappears.

Points, for update (or checkpoint) `step`:
- `before_step`: before the forward of update `step`;
- `after_step`: after the optimizer step of `step`, before its metrics, eval and checkpoint;
- `mid_checkpoint`: inside the save of `step`, after the model weights are written into the
  temporary directory, before the manifest and the rename (in the background writer thread,
  which kills the whole process all the same);
- `after_checkpoint`: after the checkpoint of `step` is renamed into place and registered with
  the service.
"""

from __future__ import annotations

import os
import signal

POINTS = ("before_step", "after_step", "mid_checkpoint", "after_checkpoint")

_armed: frozenset[tuple[str, int]] | None = None


def parse(spec: str) -> frozenset[tuple[str, int]]:
    """`"mid_checkpoint@10, after_step@3"` -> {("mid_checkpoint", 10), ("after_step", 3)}."""
    armed = set()
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, at, step = item.partition("@")
        name = name.strip()
        if name not in POINTS or not at or not step.strip().isdigit():
            raise ValueError(
                f"failpoint {item!r}: expected name@step with name one of {', '.join(POINTS)} "
                "and step a non-negative integer"
            )
        armed.add((name, int(step)))
    return frozenset(armed)


def arm(spec: str) -> None:
    """Replace the armed points (tests; the worker arms from its settings on first `hit`)."""
    global _armed
    _armed = parse(spec)


def hit(name: str, step: int) -> None:
    """SIGKILL this process when `name@step` is armed; nothing otherwise."""
    global _armed
    if _armed is None:
        from worker.settings import get_settings  # read once, on the first hit

        _armed = parse(get_settings().failpoints)
    if (name, step) in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
