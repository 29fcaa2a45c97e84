"""Owners on every road, not only the run id (issue 21), against a live `trainctl serve`
(uvicorn) on its own Postgres database with two user tokens, Alice and Bob: a checkpoint path
in the artifact store, the fleet list, an Idempotency-Key, a workflow id and an open event
stream reach no run or workflow its caller may not see; what Bob may not see answers as what
does not exist. The `names` of metric reads are bounded."""

from __future__ import annotations

import json
import queue
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from procs import Stack, processes
from weights import write_model_dir

from contracts.bounds import MAX_NAME
from service.reads.series import MAX_SERIES_PER_READ

if TYPE_CHECKING:
    from conftest import WorkflowFactory

pytestmark = pytest.mark.integration

MISSING_RUN = "run_000000000000"


class People:
    """Alice and Bob (user tokens), a viewer and the admin, each a client of one live API."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.admin = stack.api()
        self.ids: dict[str, str] = {}
        clients = {"alice": "user", "bob": "user", "viewer": "viewer"}
        self.alice, self.bob, self.viewer = (
            self.user(name, role) for name, role in clients.items()
        )

    def user(self, name: str, role: str) -> httpx.Client:
        created = self.admin.post("/tokens", json={"name": name, "role": role})
        assert created.status_code == 201, created.text
        self.ids[name] = created.json()["token"]["id"]
        secret = created.json()["secret"]
        return httpx.Client(
            base_url=self.stack.url, headers={"Authorization": f"Bearer {secret}"}, timeout=30
        )

    def __enter__(self) -> People:
        return self

    def __exit__(self, *_: object) -> None:
        for client in (self.admin, self.alice, self.bob, self.viewer):
            client.close()


def people(tmp_path: Path, postgres_url: str, procs: list[Any]) -> People:
    # The data roots hold tmp_path, and so the artifact store: a path into another run's
    # checkpoints passes the roots, and only the owner check stops it.
    return People(Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(tmp_path / "data")))


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == code, error
    return error


def assert_same_answer(
    foreign: httpx.Response, missing: httpx.Response, swap: tuple[str, str]
) -> None:
    """`foreign` (what the caller may not see) answers as `missing` (what does not exist),
    `swap` being (foreign id, missing id)."""
    assert foreign.status_code == missing.status_code == 404, (foreign.text, missing.text)
    seen, absent = foreign.json()["error"], missing.json()["error"]
    assert json.dumps(seen).replace(*swap) == json.dumps(absent), (seen, absent)


def create_run(api: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post("/runs", json=body)
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    return run


def test_the_names_a_metric_read_asks_for_are_bounded(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    with processes() as procs, people(tmp_path, postgres_url, procs) as crowd:
        run_id = create_run(crowd.alice, {"workflow": workflow})["id"]
        at_most = [f"{i:03d}".ljust(MAX_NAME, "x") for i in range(MAX_SERIES_PER_READ)]
        too_many = [*at_most, "one more"]
        too_long = ["loss", "y" * (MAX_NAME + 1)]
        for route in ("metrics", "events"):
            for names in (too_many, too_long):
                answer = crowd.alice.get(
                    f"/runs/{run_id}/{route}", params={"names": ",".join(names)}
                )
                error = assert_error(answer, 422, "invalid_request")
                assert [p["path"] for p in error["details"]] == ["query.names"], error
        answer = crowd.alice.get(f"/runs/{run_id}/metrics", params={"names": ",".join(at_most)})
        assert answer.status_code == 200 and answer.json() == {}, answer.text


class EventStream:
    """A run's event stream read on a thread; `closed` is set when the server ends it."""

    def __init__(self, client: httpx.Client, run_id: str) -> None:
        self.events: queue.Queue[str] = queue.Queue()
        self.lines: list[str] = []
        self.closed = threading.Event()
        self.response = client.send(
            client.build_request("GET", f"/runs/{run_id}/events"), stream=True
        )
        assert self.response.status_code == 200
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines():
                self.lines.append(line)
                if line.startswith("event:"):
                    self.events.put(line.removeprefix("event:").strip())
        except httpx.HTTPError:
            pass
        finally:
            self.closed.set()

    def next_event(self, timeout: float) -> str:
        return self.events.get(timeout=timeout)


def test_an_event_stream_ends_soon_after_its_token_is_revoked(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    with processes() as procs, people(tmp_path, postgres_url, procs) as crowd:
        run = create_run(crowd.alice, {"workflow": workflow})
        bobs = EventStream(crowd.bob, create_run(crowd.bob, {"workflow": workflow})["id"])
        stream = EventStream(crowd.alice, run["id"])
        assert stream.next_event(timeout=30) == "run"
        assert bobs.next_event(timeout=30) == "run"

        revoked = crowd.admin.delete(f"/tokens/{crowd.ids['alice']}")
        assert revoked.status_code == 200, revoked.text
        # The stream re-checks its token every few seconds (service/api/routes/events.py), and a
        # queued run's stream has nothing else to end it: only the revocation can.
        assert stream.closed.wait(timeout=30), "the stream went on after its token was revoked"
        assert list(stream.events.queue)[-1] == "error", stream.lines
        assert any("revoked" in line for line in stream.lines if line.startswith("data:"))
        assert not bobs.closed.is_set(), "Bob's token is still valid: his stream goes on"
        stream.response.close()
        bobs.response.close()


class Claimed:
    """A worker's claim of a run's first attempt, over HTTP with the worker token."""

    def __init__(self, stack: Stack, attempt_id: str) -> None:
        headers = {"Authorization": f"Bearer {stack.worker_token}"}
        self.client = httpx.Client(base_url=stack.url, headers=headers, timeout=30)
        self.prefix = f"/internal/attempts/{attempt_id}"
        body = {"hostname": "gpu-1", "pid": 4242, "nonce": uuid.uuid4().hex}
        answer = self.client.post(f"{self.prefix}/claim", json=body)
        assert answer.status_code == 200, answer.text
        self.claim = answer.json()
        self.secret = self.claim["fencing_token"]

    def checkpoint_dir(self, step: int) -> Path:
        return Path(self.claim["artifact_dir"]) / "checkpoints" / f"step-{step:08d}"

    def register(self, step: int) -> dict[str, Any]:
        """Writes the step's checkpoint where a worker writes it and registers it."""
        path = write_model_dir(self.checkpoint_dir(step), f"weights at step {step}")
        ref = {"path": str(path), "step": step, "phase_index": 0, "phase_step": step}
        answer = self.client.post(
            f"{self.prefix}/checkpoints", json={"fencing_token": self.secret, "checkpoint": ref}
        )
        assert answer.status_code == 200, answer.text
        registered: dict[str, Any] = answer.json()
        return registered

    def report_deleted(self, step: int) -> httpx.Response:
        body = {"fencing_token": self.secret, "step": step, "status": "deleted", "reason": "x"}
        return self.client.post(f"{self.prefix}/checkpoints/removals", json=body)


def test_the_fleet_idempotency_keys_and_workflow_ids_name_no_other_user_s_run(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    with processes() as procs, people(tmp_path, postgres_url, procs) as crowd:
        alice, bob, viewer, admin = crowd.alice, crowd.bob, crowd.viewer, crowd.admin
        alices = create_run(alice, {"workflow": workflow, "name": "alice's"})
        Claimed(crowd.stack, alices["attempts"][0]["id"])

        # GET /workers: every worker, but the run a worker runs only to who may see it.
        def running(client: httpx.Client) -> list[tuple[str | None, str | None, bool]]:
            answer = client.get("/workers")
            assert answer.status_code == 200, answer.text
            return [(w["run_id"], w["attempt_id"], w["busy"]) for w in answer.json()["workers"]]

        assert alices["id"] not in bob.get("/workers").text
        shown = (alices["id"], alices["attempts"][0]["id"], True)
        for reader in (alice, viewer, admin):
            assert running(reader) == [shown]
        assert running(bob) == [(None, None, True)]

        # An Idempotency-Key Alice used: Bob's conflict names no run, whatever his body.
        keyed = {"workflow": workflow, "name": "keyed"}
        key = {"Idempotency-Key": "nightly-1"}
        first = alice.post("/runs", json=keyed, headers=key)
        assert first.status_code == 201, first.text
        for body in (keyed, {**keyed, "name": "another body"}):
            conflict = assert_error(
                bob.post("/runs", json=body, headers=key), 409, "idempotency_conflict"
            )
            assert first.json()["id"] not in json.dumps(conflict), conflict
            assert conflict["details"] is None
        # Alice herself is told which run her key made.
        own = assert_error(
            alice.post("/runs", json={**keyed, "name": "changed"}, headers=key),
            409,
            "idempotency_conflict",
        )
        assert own["details"] == {"run_id": first.json()["id"]}

        # Workflows: a user reads and runs the ones it stored or ran; another user's id
        # answers as one that does not exist; admins and viewers see them all.
        stored = alice.post("/workflows", json={**workflow, "name": "alice's document"})
        assert stored.status_code == 201, stored.text
        workflow_id = stored.json()["id"]
        missing = "0" * 64
        swap = (workflow_id, missing)
        assert_same_answer(
            bob.get(f"/workflows/{workflow_id}"), bob.get(f"/workflows/{missing}"), swap
        )
        assert_error(bob.get(f"/workflows/{workflow_id}"), 404, "workflow_not_found")
        assert_same_answer(
            bob.post("/runs", json={"workflow_id": workflow_id}),
            bob.post("/runs", json={"workflow_id": missing}),
            swap,
        )
        for reader in (alice, viewer, admin):
            assert reader.get(f"/workflows/{workflow_id}").status_code == 200
        assert alice.post("/runs", json={"workflow_id": workflow_id}).status_code == 201
        ran = alices["workflow_id"]
        assert alice.get(f"/workflows/{ran}").status_code == 200, "Alice ran it"
        assert_error(bob.get(f"/workflows/{ran}"), 404, "workflow_not_found")
        # Bob storing the same document makes it his too: new to him (201), as if no one had.
        again = bob.post("/workflows", json={**workflow, "name": "alice's document"})
        assert again.status_code == 201 and again.json()["id"] == workflow_id, again.text
        assert (
            bob.post("/workflows", json={**workflow, "name": "alice's document"}).status_code == 200
        )
        assert bob.get(f"/workflows/{workflow_id}").status_code == 200
        assert bob.post("/runs", json={"workflow_id": workflow_id}).status_code == 201


def test_a_checkpoint_path_in_the_artifact_store_reaches_only_a_run_its_caller_may_see(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=20)
    with processes() as procs, people(tmp_path, postgres_url, procs) as crowd:
        alice, bob, admin = crowd.alice, crowd.bob, crowd.admin
        source = create_run(alice, {"workflow": workflow, "name": "alice's pretraining"})
        worker = Claimed(crowd.stack, source["attempts"][0]["id"])
        assert worker.register(4)["pinned_steps"] == []
        path = str(worker.checkpoint_dir(4))
        swap = (source["id"], MISSING_RUN)
        pretrained = {**workflow, "model": {"pretrained": path}}
        evaluation = {
            "checkpoint": path,
            "tokenizer": "tokenizer.json",
            "task": "summarization",
            "data": "summaries.jsonl",
            "sequence_length": 64,
        }
        bobs = create_run(bob, {"workflow": workflow, "name": "bob's"})

        # Every road Bob could take to Alice's weights answers as a run that does not exist.
        roads: list[tuple[str, str, Any]] = [
            ("POST", "/runs", {"workflow": workflow, "initial_checkpoint": path}),
            ("POST", f"/runs/{bobs['id']}/resume", {"initial_checkpoint": path}),
            ("POST", "/evaluations", evaluation),
            ("POST", "/runs", {"workflow": pretrained}),
            ("POST", "/workflows", pretrained),
            ("POST", "/workflows/validate", pretrained),
        ]
        for method, route, body in roads:
            foreign = bob.request(method, route, json=body)
            absent = bob.request(method, route, json=json.loads(json.dumps(body).replace(*swap)))
            assert_same_answer(foreign, absent, swap)
            assert_error(foreign, 404, "run_not_found")
        error = bob.post("/runs", json=roads[0][2]).json()["error"]
        assert error["message"].startswith("initial_checkpoint: "), error
        error = bob.post("/evaluations", json=evaluation).json()["error"]
        assert error["message"].startswith("checkpoint: "), error
        error = bob.post("/runs", json={"workflow": pretrained}).json()["error"]
        assert error["message"].startswith("model.pretrained: "), error
        assert bob.get("/runs").json()["count"] == 1, "nothing of Bob's was created"

        # Alice (and an admin) may: the path is taken as the run's registered checkpoint at
        # that step, and the run started from it pins it as {"run", "step"} does.
        tuned = create_run(alice, {"workflow": workflow, "initial_checkpoint": path})
        assert tuned["initial_checkpoint"] == path
        by_admin = create_run(admin, {"workflow": pretrained})
        assert worker.register(8)["pinned_steps"] == [4]
        refused = assert_error(worker.report_deleted(4), 409, "checkpoint_pinned")
        assert sorted(refused["details"]["pinned_by"]) == sorted([tuned["id"], by_admin["id"]])
        accepted = alice.post("/evaluations", json=evaluation)
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["request"]["checkpoint"] == path

        # A path in Alice's run folder that is no registered checkpoint directory: 422 naming
        # what to give instead.
        unregistered = write_model_dir(worker.checkpoint_dir(6))
        for given in (str(unregistered), f"{path}/model.safetensors"):
            error = assert_error(
                alice.post("/runs", json={"workflow": workflow, "initial_checkpoint": given}),
                422,
                "invalid_initial_checkpoint",
            )
            assert source["id"] in error["message"] and "4, 8" in error["message"], error

        # Files of Alice's run folder named as data or a tokenizer (a checkpoint holds its
        # tokenizer): another road to her run, closed the same way; Alice may use them.
        tokenizer = str(Path(path) / "tokenizer.json")
        Path(tokenizer).write_text((tmp_path / "data" / "tokenizer.json").read_text())
        (Path(path) / "held-out.jsonl").write_text('{"source": "a b", "target": "c"}\n')
        data = str(Path(path) / "held-out.jsonl")
        own_dir = str(write_model_dir(tmp_path / "data" / "bob-model"))
        inspected = {"path": data, "tokenizer": "tokenizer.json", "objective": "summarization"}
        file_roads: list[tuple[str, Any]] = [
            ("/runs", {"workflow": {**workflow, "tokenizer": tokenizer}}),
            (
                "/workflows/validate",
                {**workflow, "evals": [{**workflow["evals"][0], "data": data}]},
            ),
            ("/datasets/inspect", {**inspected, "sequence_length": 64}),
            ("/datasets/prepare", {**inspected, "sequence_length": 64}),
            ("/evaluations", {**evaluation, "checkpoint": own_dir, "tokenizer": tokenizer}),
            ("/evaluations", {**evaluation, "checkpoint": own_dir, "data": data}),
        ]
        for route, body in file_roads:
            foreign = bob.post(route, json=body)
            absent = bob.post(route, json=json.loads(json.dumps(body).replace(*swap)))
            assert_same_answer(foreign, absent, swap)
        assert bob.get("/runs").json()["count"] == 1, "nothing of Bob's was created"
        for route, body in file_roads:
            mine = alice.post(route, json=body)
            assert mine.status_code in (200, 201, 202), (route, mine.text)
