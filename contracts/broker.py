"""The embedded broker: kombu's filesystem transport, with puts made atomic.

kombu's own `_put` creates `<name>.msg` and then writes into it; a consumer polling the folder
can move and read the file in between and crash on an empty message (seen here, in the demo's
first dispatch). Writing under a name the consumer ignores and renaming into place closes that
window: a rename within one folder is atomic.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


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
