"""trainctl's Python client: the public API over httpx, answered with the pydantic models the
service answers with (contracts.api, contracts.jobs), and every error answer as an ApiError.

-> contracts, runtime, httpx and pydantic; never the service, the worker, torch or the CLI
(the CLI is this client's first user).
"""

from client.client import Client
from client.events import Event
from client.http import ApiError

__all__ = ["ApiError", "Client", "Event"]
