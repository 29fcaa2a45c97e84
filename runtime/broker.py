"""The broker's URL and options, and the embedded broker: kombu's filesystem transport, with
puts made atomic.

kombu's own `_put` creates `<name>.msg` and then writes into it; a consumer polling the folder
can move and read the file in between and crash on an empty message (seen here, in the demo's
first dispatch). Writing under a name the consumer ignores and renaming into place closes that
window: a rename within one folder is atomic.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.json import dumps

# kombu's filesystem transport polls its folder; 0.1 s keeps a dispatch near 50 ms.
FILESYSTEM_POLL_SECONDS = 0.1
# The URL scheme under which this module's atomic filesystem transport is registered.
EMBEDDED_SCHEME = "trainctl-filesystem"


class Channel(filesystem.Channel):
    # kombu's own bases disagree on this signature; this one matches filesystem.Channel.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # The consumer only takes names ending in ".<queue>.msg"; this one it skips.
        partial = os.path.join(self.data_folder_out, f"partial-{uuid.uuid4()}")
        try:
            with open(partial, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def broker_options(broker_url: str) -> tuple[str, dict[str, Any]]:
    """(Celery broker URL, transport options). `filesystem:///some/dir` is the embedded broker:
    every process pointing at the same folder shares one queue, no server needed."""
    if not broker_url.startswith("filesystem://"):
        return broker_url, {}
    TRANSPORT_ALIASES.setdefault(EMBEDDED_SCHEME, f"{__name__}:Transport")
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
