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
