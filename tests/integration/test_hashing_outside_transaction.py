"""POST /runs and POST /runs/{id}/resume hash their inputs (seconds per GiB) with no
transaction open: concurrent submissions of large inputs must not hold Postgres connections
idle in transaction (nor a checkpoint row locked) while they hash."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.engine import make_url
from weights import write_model_dir

import runtime.digest
from contracts.signature import sha256_path
from runtime.digest import clear_digest_cache
from service.models import Attempt, Checkpoint, Run, utcnow

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


class HeldHash:
    """Stands in for the hash function the digest cache (runtime.digest) uses: while held,
    every call says it is hashing, then waits until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()
        self.hashing = threading.Condition(self.lock)
        self.released = threading.Event()

    def hold(self) -> None:
        """Hold the calls from now on, counting them from 0 (the digest cache is emptied, so
        every input is hashed again)."""
        with self.lock:
            self.calls = 0
            self.released.clear()
        clear_digest_cache()

    def __call__(self, path: Path, progress: Callable[[], None] | None = None) -> str:
        with self.lock:
            self.calls += 1
            self.hashing.notify_all()
        assert self.released.wait(30), "the test never released the hash"
        return sha256_path(path)

    def wait_for(self, calls: int) -> None:
        with self.lock:
            assert self.hashing.wait_for(lambda: self.calls >= calls, timeout=30)


@pytest.fixture
def held_hash(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldHash]:
    held = HeldHash()
    held.hold()
    monkeypatch.setattr(runtime.digest, "sha256_path", held)
    yield held
    held.released.set()
    clear_digest_cache()


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    # The outbox and reaper passes run once at start-up only: the connections seen while a
    # request hashes are then the requests' own.
    return make_api(make_settings(outbox_interval_seconds=3600, reaper_interval_seconds=3600))


def idle_in_transaction(api: Api, admin_url: str) -> list[str]:
    """The last statement of every connection to the test's database that has sat idle inside
    a transaction for half a second or more: a submission holding one across its held hashing
    has; the app's background loops (reaper, outbox) are caught between a BEGIN and their next
    statement only for an instant on a loaded machine, and are not counted."""
    database = make_url(api.settings.database_url).database
    with psycopg.connect(admin_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity "
            "WHERE datname = %s AND state LIKE 'idle in transaction%%' "
            "AND state_change < now() - interval '500 milliseconds'",
            (database,),
        ).fetchall()
    return [row[0] for row in rows]


def in_thread(send: Callable[[], Any]) -> Callable[[], Any]:
    """Start `send` in a thread; the returned function joins it and gives its response."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(send()), daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(30)
        assert answer, "the request did not answer"
        return answer[0]

    return join


def register_checkpoint(api: Api, run: dict[str, Any], step: int) -> Path:
    """A checkpoint directory of `run` at `step`, registered as a worker would have."""
    path = (
        Path(api.settings.artifact_root) / "runs" / run["id"] / "checkpoints" / f"step-{step:08d}"
    )
    write_model_dir(path, f"weights at step {step}")
    with api.sessions() as session:
        attempt = session.get(Attempt, run["attempts"][0]["id"])
        assert attempt is not None
        session.add(
            Checkpoint(
                run_id=run["id"],
                attempt_id=attempt.id,
                step=step,
                phase_index=0,
                phase_step=step,
                path=str(path),
            )
        )
        session.commit()
    return path


def submit(api: Api, body: dict[str, Any], key: str | None = None) -> Any:
    headers = {**api.admin, **({"Idempotency-Key": key} if key else {})}
    return api.client.post("/runs", json=body, headers=headers)


@pytest.mark.parametrize("initial", ["none", "another run's checkpoint"])
def test_submission_hashes_with_no_transaction_open(
    api: Api,
    tiny_workflow: WorkflowFactory,
    held_hash: HeldHash,
    postgres_admin_url: str,
    initial: str,
) -> None:
    workflow = tiny_workflow(phases=1)
    body: dict[str, Any] = {"workflow": workflow}
    if initial != "none":
        held_hash.released.set()
        source = submit(api, {"workflow": workflow}).json()
        body["initial_checkpoint"] = {"run": source["id"], "step": 5}
        checkpoint = register_checkpoint(api, source, 5)
        held_hash.hold()

    answer = in_thread(lambda: submit(api, body, key="hashing-1"))
    held_hash.wait_for(1)
    time.sleep(1.0)  # a transaction held across the hashing is idle for this long by now
    idle = idle_in_transaction(api, postgres_admin_url)
    held_hash.released.set()
    created = answer()

    assert idle == []
    assert created.status_code == 201, created.text
    if initial != "none":
        assert created.json()["initial_checkpoint"] == str(checkpoint)
    again = submit(api, body, key="hashing-1")
    assert again.status_code == 200, again.text
    assert again.json()["id"] == created.json()["id"]


def test_an_initial_checkpoint_deleted_while_hashing_is_refused(
    api: Api, tiny_workflow: WorkflowFactory, held_hash: HeldHash
) -> None:
    workflow = tiny_workflow(phases=1)
    held_hash.released.set()
    source = submit(api, {"workflow": workflow}).json()
    register_checkpoint(api, source, 5)
    held_hash.hold()

    body = {"workflow": workflow, "initial_checkpoint": {"run": source["id"], "step": 5}}
    answer = in_thread(lambda: submit(api, body))
    held_hash.wait_for(1)
    # Its worker's retention deletes it meanwhile (no run names it yet, so nothing pins it).
    with api.sessions() as session:
        session.execute(
            update(Checkpoint)
            .where(Checkpoint.run_id == source["id"], Checkpoint.step == 5)
            .values(status="deleted", reason="retention keeps the last 2", removed_at=utcnow())
        )
        session.commit()
    held_hash.released.set()
    refused = answer()

    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_initial_checkpoint"
    assert error["details"]["status"] == "deleted"
    with api.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Run)) == 1  # the source only


def test_resume_hashes_with_no_transaction_open(
    api: Api, tiny_workflow: WorkflowFactory, held_hash: HeldHash, postgres_admin_url: str
) -> None:
    held_hash.released.set()
    run = submit(api, {"workflow": tiny_workflow(phases=1)}).json()
    cancelled = api.client.post(f"/runs/{run['id']}/cancel", headers=api.admin)
    assert cancelled.status_code == 200, cancelled.text
    held_hash.hold()

    answer = in_thread(
        lambda: api.client.post(f"/runs/{run['id']}/resume", json={}, headers=api.admin)
    )
    held_hash.wait_for(1)
    time.sleep(1.0)  # a transaction held across the hashing is idle for this long by now
    idle = idle_in_transaction(api, postgres_admin_url)
    held_hash.released.set()
    resumed = answer()

    assert idle == []
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "recovering"


def test_one_key_submitted_twice_while_hashing_makes_one_run(
    api: Api, tiny_workflow: WorkflowFactory, held_hash: HeldHash
) -> None:
    body = {"workflow": tiny_workflow(phases=1)}
    first = in_thread(lambda: submit(api, body, key="twice"))
    second = in_thread(lambda: submit(api, body, key="twice"))
    held_hash.wait_for(2)  # both passed the idempotency lookup and are hashing
    held_hash.released.set()
    answers = [first(), second()]

    assert sorted(a.status_code for a in answers) == [200, 201], [a.text for a in answers]
    assert answers[0].json()["id"] == answers[1].json()["id"]
