"""Names and broker options shared by the side that sends work and the side that runs it.

The service sends tasks by name (`send_task`), so it never imports the worker's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RUN_PHASE_TASK = "trainctl.run_phase"
# Jobs (contracts.jobs): args (job_id, request as a JSON-able dict).
INSPECT_DATASET_TASK = "trainctl.inspect_dataset"
EVALUATE_CHECKPOINT_TASK = "trainctl.evaluate_checkpoint"
DEFAULT_QUEUE = "trainctl"

# kombu's filesystem transport polls its folder; 0.1 s keeps a dispatch near 50 ms.
FILESYSTEM_POLL_SECONDS = 0.1


# The URL scheme under which contracts.broker's atomic filesystem transport is registered.
EMBEDDED_SCHEME = "trainctl-filesystem"


def broker_options(broker_url: str) -> tuple[str, dict[str, Any]]:
    """(Celery broker URL, transport options). `filesystem:///some/dir` is the embedded broker:
    every process pointing at the same folder shares one queue, no server needed."""
    if not broker_url.startswith("filesystem://"):
        return broker_url, {}
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault(EMBEDDED_SCHEME, "contracts.broker:Transport")
    folder = Path(broker_url.removeprefix("filesystem://"))
    queue = folder / "queue"
    processed = folder / "processed"
    control = folder / "control"  # exchange tables; kombu's default is ./control in the cwd
    for path in (queue, processed, control):
        path.mkdir(parents=True, exist_ok=True)
    return f"{EMBEDDED_SCHEME}://", {
        "data_folder_in": str(queue),
        "data_folder_out": str(queue),
        "processed_folder": str(processed),
        "control_folder": str(control),
        "store_processed": False,
        "polling_interval": FILESYSTEM_POLL_SECONDS,
    }
