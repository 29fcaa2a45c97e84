"""The wire under the client: requests and downloads over httpx, and every answer that is not
a success (or no answer at all) turned into an ApiError with the service's error fields."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx


class ApiError(Exception):
    """An error answer, `{"error": {"code", "message", "details"}}`, with its HTTP status; or,
    with status 0, no answer (`unreachable`, `bad_request`: a malformed URL)."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


class Http:
    """A connection to the API at `base_url` with a bearer `token` (none when empty)."""

    def __init__(self, base_url: str, token: str, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON body of a successful answer."""
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise ApiError(0, "unreachable", f"cannot reach {self._http.base_url}: {err}") from err
        except httpx.HTTPError as err:  # e.g. a malformed TRAINCTL_API_URL
            raise ApiError(0, "bad_request", f"{method} {path}: {err}") from err
        if not response.is_success:
            self._raise(response)
        try:
            return response.json()
        except ValueError:
            raise ApiError(
                response.status_code, "not_json", f"{self._http.base_url} answered non-JSON"
            ) from None

    def download(self, path: str, dest: Path, **kwargs: Any) -> None:
        """GET `path` and write its body to `dest` as it streams in: into a temporary file
        beside it, renamed over `dest` once whole (an error leaves `dest` as it was)."""
        partial = dest.with_name(f".{dest.name}.partial")
        try:
            with self._http.stream("GET", path, **kwargs) as response:
                if not response.is_success:
                    response.read()
                    self._raise(response)
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes():
                        out.write(chunk)
            os.replace(partial, dest)
        except httpx.TransportError as err:
            raise ApiError(0, "unreachable", f"cannot reach {self._http.base_url}: {err}") from err
        finally:
            partial.unlink(missing_ok=True)

    def lines(self, path: str, **kwargs: Any) -> Iterator[str]:
        """GET `path` and yield its body line by line as it arrives (a stream that lasts)."""
        try:
            with self._http.stream("GET", path, **kwargs) as response:
                if not response.is_success:
                    response.read()
                    self._raise(response)
                yield from response.iter_lines()
        except httpx.TransportError as err:
            raise ApiError(0, "unreachable", f"cannot reach {self._http.base_url}: {err}") from err

    def _raise(self, response: httpx.Response) -> NoReturn:
        try:
            error = response.json()["error"]
            raise ApiError(response.status_code, error["code"], error["message"], error["details"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(response.status_code, "http_error", response.text[:500]) from None
