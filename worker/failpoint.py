"""Fault injection for tests: kill, slow or hang this worker at an exact instant of the loop, or
fail a write there as a full disk does.

A test knob, never a production one: tests arm points with `TRAINCTL_TEST_FAILPOINTS`
(comma-separated), and the worker refuses to start with it set unless `TRAINCTL_TESTING=1`
(worker/settings.py). Unarmed, `hit` costs a dict lookup.

Points, for update (or checkpoint) `step`:
- `before_step`: before the forward of update `step`;
- `after_step`: after the optimizer step of `step`, before its metrics, eval and checkpoint;
- `mid_checkpoint`: inside the save of `step`, after the model weights are written into the
  temporary directory, before the manifest and the rename (in the background writer thread);
- `mid_upload`: with an object store as artifact store, after the save's files are uploaded,
  before its manifest commits it (in the background writer thread);
- `after_checkpoint`: after the checkpoint of `step` is renamed into place and registered with
  the service.

What happens there:
- `point@step` (e.g. `mid_checkpoint@10`): SIGKILL the process. Not an exception: nothing (no
  `finally`, no atexit, no flush) may run, as when a spot instance disappears. From the
  background writer thread it kills the whole process all the same.
- `slow_point@step=seconds` (e.g. `slow_before_step@3=6`): sleep that long in the calling
  thread, as a slow device or a long gradient accumulation would, then go on.
- `hang_point@step` (e.g. `hang_before_step@3`): block the calling thread forever. The
  process and its other threads (the lease keeper's heartbeats, the metrics server) stay
  alive: a hung worker, not a dead one, which only its stalled progress gives away.
- `full_point@step` (e.g. `full_mid_checkpoint@8`): raise OSError(ENOSPC), as a write to a
  full disk does there; a checkpoint of a full store, without filling one.

Slow and hang log a line naming the point before they act.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time

from worker.failpoint_spec import Armed, parse
from worker.settings import get_settings

log = logging.getLogger(__name__)

_armed: dict[tuple[str, int], Armed] | None = None
# Set by nothing: `hang` waits on it forever (a unit test swaps in one it can set).
_never = threading.Event()


def arm(spec: str) -> None:
    """Replace the armed points (tests; the worker arms from its settings on first `hit`)."""
    global _armed
    _armed = parse(spec)


def hit(name: str, step: int) -> None:
    """Kill, slow, hang or fail as a full disk here when `name@step` is armed; nothing
    otherwise."""
    global _armed
    if _armed is None:
        # The settings are read once, on the first hit.
        _armed = parse(get_settings().test_failpoints)
    armed = _armed.get((name, step))
    if armed is None:
        return
    if armed.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif armed.action == "full":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (failpoint {armed.spec})")
    elif armed.action == "slow":
        log.warning("failpoint %s: sleeping %.1f s in this thread", armed.spec, armed.seconds)
        time.sleep(armed.seconds)
    else:
        log.warning("failpoint %s: hanging this thread forever", armed.spec)
        _never.wait()
