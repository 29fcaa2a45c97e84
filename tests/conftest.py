"""Fixtures for every test directory (values reach tests only as fixtures: see
tests/unit/test_test_layout.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

Rewrite = Callable[[Path, bytes], None]


@pytest.fixture
def rewrite_in_place() -> Rewrite:
    """`rewrite_in_place(path, content)`: `content` written over the bytes of `path` (same size,
    same inode) and its access and modification times put back to the nanosecond, as `cp -p`,
    `rsync -a` and `tar x` leave a file they overwrite. Returns once the file's ctime differs
    from before: the kernel stamps ctime from a coarse clock (a tick of a few ms), so a rewrite
    within the tick of the file's last change would keep it, which a copy made later never
    does."""

    def rewrite(path: Path, content: bytes) -> None:
        before = path.stat()
        assert len(content) == before.st_size, "a rewrite in place keeps the size"
        with open(path, "r+b") as f:
            f.write(content)
        deadline = time.monotonic() + 5
        while True:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = path.stat()
            if after.st_ctime_ns != before.st_ctime_ns:
                break
            assert time.monotonic() < deadline, f"{path}: ctime did not move in 5 s"
        same = (after.st_size, after.st_mtime_ns, after.st_ino)
        assert same == (before.st_size, before.st_mtime_ns, before.st_ino)

    return rewrite


@dataclass(frozen=True)
class S3:
    """A bucket of its own on the loopback S3 server (moto in server mode, talked to over the
    S3 HTTP API only): `root` is an artifact root in it, `env` the AWS variables that reach it
    (already set in this process for the test's duration; hand them to subprocesses)."""

    endpoint: str
    bucket: str
    env: dict[str, str]

    @property
    def root(self) -> str:
        return f"s3://{self.bucket}/artifacts"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free loopback port for this test process; its endpoint URL. Fails
    loudly (never skips) when it cannot start."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=2)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"moto's S3 server did not start on {endpoint} (pip install "
                        f"'moto[server]'): {log.read_text()[-2000:]}",
                        pytrace=False,
                    )
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> S3:
    """A fresh bucket on the loopback S3 server, with the AWS variables set to reach it."""
    bucket = f"tc-{uuid.uuid4().hex[:16]}"
    answer = httpx.put(f"{s3_server}/{bucket}", timeout=10)
    assert answer.status_code == 200, answer.text
    env = {
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_ACCESS_KEY_ID": "trainctl-test",
        "AWS_SECRET_ACCESS_KEY": "trainctl-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return S3(endpoint=s3_server, bucket=bucket, env=env)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
