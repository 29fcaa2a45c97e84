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
DEFAULT_QUEUE = "trainctl"
