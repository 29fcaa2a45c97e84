"""Names shared by the side that sends work and the side that runs it.

The service sends tasks by name (`send_task`), so it never imports the worker's code. The
broker's URL and transport options are runtime.broker's.
"""

from __future__ import annotations

RUN_PHASE_TASK = "trainctl.run_phase"
# Jobs (contracts.jobs): args (job_id, request as a JSON-able dict).
INSPECT_DATASET_TASK = "trainctl.inspect_dataset"
EVALUATE_CHECKPOINT_TASK = "trainctl.evaluate_checkpoint"
PREPARE_DATASET_TASK = "trainctl.prepare_dataset"
# The content digest of an object store input, which the service never downloads.
DIGEST_INPUT_TASK = "trainctl.digest_input"
DEFAULT_QUEUE = "trainctl"


def devices_queue(queue: str, devices: int) -> str:
    """The queue of attempts that need `devices` ranks on one worker: `queue` itself for one
    (what every worker consumes), `<queue>.devices-N` for more. A worker that owns D devices
    consumes every queue it can serve (`served_queues`), so a phase reaches only workers big
    enough for it, and any of them."""
    return queue if devices <= 1 else f"{queue}.devices-{devices}"


def served_queues(queue: str, devices: int) -> list[str]:
    """The queues a worker that owns `devices` devices consumes: one per rank count it can
    run, 1 to `devices`."""
    return [devices_queue(queue, n) for n in range(1, max(devices, 1) + 1)]


# What a worker key may hold: it is part of a queue's name (Redis key, a file name on the
# filesystem transport).
_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
MAX_WORKER_KEY = 120


def worker_key(hostname: str, pid: int, boot: str) -> str:
    """A worker process's stable key for this life of it: its hostname (other characters as
    `-`, at most 80), pid and a random boot id (a pid reused after a restart is another key)."""
    host = "".join(c if c in _KEY_CHARS else "-" for c in hostname)[:80] or "host"
    return f"{host}-{pid}-{boot}"[:MAX_WORKER_KEY]


def worker_queue(queue: str, key: str) -> str:
    """The worker's own queue, `<queue>.worker.<key>`: the service sends an attempt it placed
    on that worker there (service.workers.placement), and only that worker consumes it."""
    return f"{queue}.worker.{key}"
