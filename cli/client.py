"""A small client of the public API that turns error bodies into readable exceptions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import httpx


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


class ApiClient:
    def __init__(self, base_url: str, token: str, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:
            raise ApiError(0, "unreachable", f"cannot reach {self._http.base_url}: {err}") from err
        except httpx.HTTPError as err:  # e.g. a malformed TRAINCTL_API_URL
            raise ApiError(0, "bad_request", f"{method} {path}: {err}") from err
        if response.is_success:
            try:
                return response.json()
            except ValueError:
                raise ApiError(
                    response.status_code, "not_json", f"{self._http.base_url} answered non-JSON"
                ) from None
        try:
            error = response.json()["error"]
            raise ApiError(response.status_code, error["code"], error["message"], error["details"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(response.status_code, "http_error", response.text[:500]) from None

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

    def _raise(self, response: httpx.Response) -> NoReturn:
        try:
            error = response.json()["error"]
            raise ApiError(response.status_code, error["code"], error["message"], error["details"])
        except (ValueError, KeyError, TypeError):
            raise ApiError(response.status_code, "http_error", response.text[:500]) from None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)
