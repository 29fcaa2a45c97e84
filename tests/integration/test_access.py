"""Roles and owners, tokens and the audit trail, against a live `trainctl serve` (uvicorn) on its
own Postgres database: a user token sees and controls only its own runs and jobs (another
owner's are 404 on every route that takes an id), a viewer reads everything and changes
nothing (403), tokens are listed, revoked and rotated (refused at once), and every change is in
`GET /audit`, readable by admins only."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from procs import Stack, cli, processes, run_cli, start_api

if TYPE_CHECKING:
    from conftest import WorkflowFactory

pytestmark = pytest.mark.integration


def client(stack: Stack, token: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=stack.url, headers=headers, timeout=30)


def make_stack(tmp_path: Path, postgres_url: str, procs: list[Any]) -> Stack:
    return Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(tmp_path / "data"))


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    assert set(error) == {"code", "message", "details"}
    return error


def create_run(api: httpx.Client, workflow: dict[str, Any], name: str) -> str:
    response = api.post("/runs", json={"workflow": workflow, "name": name})
    assert response.status_code == 201, response.text
    run_id: str = response.json()["id"]
    return run_id


def inspect(api: httpx.Client) -> str:
    response = api.post(
        "/datasets/inspect",
        json={
            "path": "pretrain.jsonl",
            "tokenizer": "tokenizer.json",
            "objective": "continued_pretrain",
            "sequence_length": 64,
        },
    )
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


# Every route that takes a run's id: (method, path template, body).
RUN_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/runs/{id}", None),
    ("GET", "/runs/{id}/metrics", None),
    ("GET", "/runs/{id}/eval", None),
    ("GET", "/runs/{id}/checkpoints", None),
    ("GET", "/runs/{id}/events", None),
    ("POST", "/runs/{id}/pause", None),
    ("POST", "/runs/{id}/resume", {}),
    ("POST", "/runs/{id}/cancel", None),
]


def test_a_user_sees_and_controls_only_its_own_runs_and_jobs(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    with processes() as procs:
        stack = make_stack(tmp_path, postgres_url, procs)
        alice_token, bob_token = stack.token("user"), stack.token("user")
        viewer_token = stack.token("viewer")
        with (
            stack.api() as admin,
            client(stack, alice_token) as alice,
            client(stack, bob_token) as bob,
            client(stack, viewer_token) as viewer,
        ):
            admins_run = create_run(admin, workflow, "admin's")
            alices = [create_run(alice, workflow, f"alice {i}") for i in range(3)]
            bobs = create_run(bob, workflow, "bob's")
            alice_job, bob_job = inspect(alice), inspect(bob)

            # Another owner's run is 404 on every route that takes its id, as one that does not
            # exist is; the owner's own answers.
            for method, template, body in RUN_ROUTES:
                path = template.format(id=bobs)
                foreign = alice.request(method, path, json=body)
                missing = alice.request(method, template.format(id="run_000000000000"), json=body)
                error = assert_error(foreign, 404, "run_not_found")
                absent = assert_error(missing, 404, "run_not_found")
                assert error["message"].replace(bobs, "?") == absent["message"].replace(
                    "run_000000000000", "?"
                )
                assert error["details"] == absent["details"]
                admins = alice.request(method, template.format(id=admins_run), json=body)
                assert_error(admins, 404, "run_not_found")
            assert alice.get(f"/runs/{alices[0]}/metrics").status_code == 200
            assert alice.get(f"/runs/{alices[0]}/checkpoints").status_code == 200
            assert alice.post(f"/runs/{alices[0]}/pause").json()["status"] == "paused"
            assert alice.post(f"/runs/{alices[0]}/resume", json={}).status_code == 200
            assert alice.post(f"/runs/{alices[1]}/cancel").json()["status"] == "cancelled"
            # Bob's run was left alone.
            assert bob.get(f"/runs/{bobs}").json()["status"] == "queued"

            # Another run's checkpoint as initial weights: as if that run did not exist.
            error = assert_error(
                alice.post(
                    "/runs",
                    json={"workflow": workflow, "initial_checkpoint": {"run": bobs, "step": 4}},
                ),
                404,
                "run_not_found",
            )
            assert "does not exist" in error["message"]
            # Bob's Idempotency-Key does not hand Bob's run to Alice.
            body = {"workflow": workflow, "name": "keyed"}
            keyed = bob.post("/runs", json=body, headers={"Idempotency-Key": "k-1"}).json()["id"]
            replay = alice.post("/runs", json=body, headers={"Idempotency-Key": "k-1"})
            assert_error(replay, 409, "idempotency_conflict")
            assert keyed not in replay.text

            # Lists: a user's own runs only, `count` and cursor pages included.
            page = alice.get("/runs", params={"limit": 2}).json()
            assert page["count"] == 3 and len(page["runs"]) == 2 and page["next_cursor"]
            rest = alice.get("/runs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
            assert rest["next_cursor"] is None
            assert {r["id"] for r in page["runs"] + rest["runs"]} == set(alices)
            assert alice.get("/runs", params={"status": "cancelled"}).json()["count"] == 1
            assert {r["id"] for r in bob.get("/runs").json()["runs"]} == {bobs, keyed}
            everything = {admins_run, *alices, bobs, keyed}
            for reader in (admin, viewer):
                listed = reader.get("/runs").json()
                assert listed["count"] == 6 and {r["id"] for r in listed["runs"]} == everything

            # Jobs: the owner's and an admin's or viewer's to read; 404 to another user.
            assert alice.get(f"/datasets/inspections/{alice_job}").status_code == 200
            error = assert_error(
                alice.get(f"/datasets/inspections/{bob_job}"), 404, "inspection_not_found"
            )
            assert bob_job in error["message"]
            for reader in (admin, viewer, bob):
                assert reader.get(f"/datasets/inspections/{bob_job}").status_code == 200

            # A viewer reads everything and changes nothing: every write is 403.
            assert viewer.get(f"/runs/{bobs}").status_code == 200
            assert viewer.get(f"/runs/{bobs}/eval").status_code == 200
            assert viewer.get("/workers").status_code == 200
            writes: list[tuple[str, str, Any]] = [
                ("POST", "/runs", {"workflow": workflow}),
                ("POST", f"/runs/{bobs}/pause", None),
                ("POST", f"/runs/{bobs}/resume", {}),
                ("POST", f"/runs/{bobs}/cancel", None),
                ("POST", "/workflows", workflow),
                ("POST", "/workflows/validate", workflow),
                ("POST", "/datasets/inspect", {"path": "a", "tokenizer": "b"}),
                ("POST", "/datasets/prepare", {}),
                ("POST", "/evaluations", {}),
                ("POST", "/tokens", {"name": "x"}),
                ("DELETE", f"/tokens/{'tok_000000000000'}", None),
            ]
            for method, path, body in writes:
                error = assert_error(viewer.request(method, path, json=body), 403, "forbidden")
                assert viewer_token not in json.dumps(error)
            assert viewer.get(f"/runs/{bobs}").json()["status"] == "queued"

            # Worker tokens stay off the public API.
            with client(stack, stack.worker_token) as worker:
                assert_error(worker.get("/runs"), 403, "forbidden")
                assert_error(worker.get(f"/runs/{bobs}/events"), 403, "forbidden")

            # What each token may do, for the dashboard.
            me = viewer.get("/whoami").json()
            assert me["role"] == "viewer" and not me["can_write"] and me["sees_all"]
            me = alice.get("/whoami").json()
            assert me["role"] == "user" and me["can_write"] and not me["sees_all"]
            assert admin.get("/whoami").json()["is_admin"]


def test_tokens_are_listed_revoked_and_rotated_and_every_change_is_audited(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    with processes() as procs:
        stack = make_stack(tmp_path, postgres_url, procs)
        with stack.api() as admin:
            created = admin.post("/tokens", json={"name": "carol", "role": "user"})
            assert created.status_code == 201, created.text
            carol_id, carol_secret = created.json()["token"]["id"], created.json()["secret"]
            assert created.json()["token"]["role"] == "user"

            # Listing never shows a secret or its hash.
            listed = admin.get("/tokens")
            assert listed.status_code == 200
            rows = listed.json()["tokens"]
            assert carol_id in {t["id"] for t in rows}
            assert set(rows[0]) == {
                "id",
                "name",
                "role",
                "created_at",
                "rotated_at",
                "revoked_at",
                "max_devices",
            }
            assert carol_secret not in listed.text
            assert stack.admin not in listed.text and stack.worker_token not in listed.text

            # Only admins manage tokens and read the audit trail.
            with (
                client(stack, carol_secret) as carol,
                client(stack, stack.token("viewer")) as viewer,
            ):
                for other in (carol, viewer):
                    for method, path in (
                        ("GET", "/tokens"),
                        ("POST", "/tokens"),
                        ("POST", f"/tokens/{carol_id}/rotate"),
                        ("DELETE", f"/tokens/{carol_id}"),
                        ("GET", "/audit"),
                    ):
                        body = {"name": "x"} if method == "POST" else None
                        assert_error(other.request(method, path, json=body), 403, "forbidden")
                run_id = create_run(carol, workflow, "carol's")
                carol.post(f"/runs/{run_id}/pause").raise_for_status()
                carol.post(f"/runs/{run_id}/pause").raise_for_status()  # a no-op: no event
                carol.post(f"/runs/{run_id}/resume", json={}).raise_for_status()
                carol.post(f"/runs/{run_id}/cancel").raise_for_status()
                job_id = inspect(carol)

                # Rotation: the old secret is refused at once, the new one works, the runs stay.
                rotated = admin.post(f"/tokens/{carol_id}/rotate")
                assert rotated.status_code == 200, rotated.text
                new_secret = rotated.json()["secret"]
                assert new_secret != carol_secret and rotated.json()["token"]["rotated_at"]
                assert_error(carol.get("/runs"), 401, "unauthorized")
                with client(stack, new_secret) as carol2:
                    assert [r["id"] for r in carol2.get("/runs").json()["runs"]] == [run_id]

                    # Revocation: refused from the very next request.
                    revoked = admin.delete(f"/tokens/{carol_id}")
                    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
                    error = assert_error(carol2.get("/runs"), 401, "unauthorized")
                    assert new_secret not in json.dumps(error)
                    assert_error(admin.post(f"/tokens/{carol_id}/rotate"), 409, "token_revoked")
            assert carol_id not in {t["id"] for t in admin.get("/tokens").json()["tokens"]}
            every = admin.get("/tokens", params={"revoked": True}).json()["tokens"]
            assert carol_id in {t["id"] for t in every}
            # Her runs stay, readable by admins.
            assert admin.get(f"/runs/{run_id}").json()["status"] == "cancelled"

            # The audit trail: who, what, which, when and from where; newest first.
            events = admin.get("/audit").json()["events"]
            mine = [
                (e["action"], e["target_id"])
                for e in events
                if e["target_id"] in (carol_id, run_id, job_id)
            ]
            assert mine == [
                ("token.revoke", carol_id),
                ("token.rotate", carol_id),
                ("job.create", job_id),
                ("run.cancel", run_id),
                ("run.resume", run_id),
                ("run.pause", run_id),
                ("run.create", run_id),
                ("token.create", carol_id),
            ]
            by_action = {e["action"]: e for e in events if e["target_id"] in (carol_id, run_id)}
            assert by_action["run.create"]["actor_token_id"] == carol_id
            assert by_action["run.create"]["actor_name"] == "carol"
            assert by_action["run.create"]["actor_role"] == "user"
            assert by_action["run.create"]["client_address"] == "127.0.0.1"
            assert by_action["token.rotate"]["actor_name"] == "admin"  # the Stack's admin token
            assert by_action["token.create"]["details"] == {"name": "carol", "role": "user"}
            assert all(e["at"] for e in events)
            assert carol_secret not in json.dumps(events) and new_secret not in json.dumps(events)

            # Paged by cursor, filtered by action and target.
            first = admin.get("/audit", params={"limit": 3}).json()
            second = admin.get("/audit", params={"limit": 3, "cursor": first["next_cursor"]})
            ids = [e["id"] for e in first["events"] + second.json()["events"]]
            assert ids == sorted(ids, reverse=True) and len(set(ids)) == 6
            pauses = admin.get("/audit", params={"action": "run.pause"}).json()["events"]
            assert [e["target_id"] for e in pauses] == [run_id]
            targeted = admin.get("/audit", params={"target_id": carol_id}).json()["events"]
            assert [e["action"] for e in targeted] == [
                "token.revoke",
                "token.rotate",
                "token.create",
            ]
            assert_error(admin.get("/audit", params={"cursor": "x"}), 422, "invalid_request")


def test_the_tokens_commands_list_revoke_and_rotate_into_a_0600_file(
    tmp_path: Path, postgres_url: str
) -> None:
    with processes() as procs:
        stack = make_stack(tmp_path, postgres_url, procs)
        secret = run_cli(
            ["tokens", "create", "--name", "dave", "--role", "viewer"], env=stack.env
        ).strip()
        listed = json.loads(run_cli(["tokens", "list", "--json"], env=stack.env))
        (dave,) = [t for t in listed["tokens"] if t["name"] == "dave"]
        assert dave["role"] == "viewer"
        text = run_cli(["tokens", "list"], env=stack.env) + json.dumps(listed)
        for token in (secret, stack.admin, stack.worker_token):
            assert token not in text

        out = tmp_path / "secrets" / "dave-token"
        out.parent.mkdir()
        out.write_text("old\n")
        out.chmod(0o644)
        rotated = cli(["tokens", "rotate", dave["id"], "--out", str(out)], env=stack.env)
        assert rotated.returncode == 0, rotated.stderr
        new_secret = out.read_text().strip()
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        assert new_secret not in rotated.stdout + rotated.stderr
        with client(stack, secret) as old, client(stack, new_secret) as new:
            assert_error(old.get("/runs"), 401, "unauthorized")
            assert new.get("/runs").status_code == 200
            run_cli(["tokens", "revoke", dave["id"]], env=stack.env)
            assert_error(new.get("/runs"), 401, "unauthorized")
        listed = json.loads(run_cli(["tokens", "list", "--json"], env=stack.env))
        assert dave["id"] not in {t["id"] for t in listed["tokens"]}
        listed = json.loads(run_cli(["tokens", "list", "--json", "--revoked"], env=stack.env))
        assert dave["id"] in {t["id"] for t in listed["tokens"]}
        missing = cli(["tokens", "revoke", "tok_000000000000"], env=stack.env)
        assert missing.returncode == 2 and "token_not_found" in missing.stderr

        with stack.api() as admin:
            events = admin.get("/audit", params={"target_id": dave["id"]}).json()["events"]
        assert [e["action"] for e in events] == ["token.revoke", "token.rotate", "token.create"]
        assert all(e["actor_name"].startswith("trainctl tokens (") for e in events)
        assert all(e["actor_token_id"] is None and e["client_address"] for e in events)


def test_a_job_s_outcome_is_taken_only_from_the_worker_token_that_started_it(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    tiny_workflow(phases=1, steps=4)  # its data files
    outcome = {"status": "failed", "error": "the file could not be read"}
    with processes() as procs:
        stack = make_stack(tmp_path, postgres_url, procs)
        with (
            stack.api() as admin,
            client(stack, stack.worker_token) as first,
            client(stack, stack.token("worker")) as second,
        ):
            job_id = inspect(admin)
            assert first.post(f"/internal/jobs/{job_id}/start").status_code == 200
            error = assert_error(
                second.post(f"/internal/jobs/{job_id}/result", json=outcome), 403, "forbidden"
            )
            assert job_id in error["message"] and stack.worker_token not in error["message"]
            # Started again by the second (the first one's message was delivered twice, say):
            # now only the second's outcome is taken.
            assert second.post(f"/internal/jobs/{job_id}/start").status_code == 200
            refused = first.post(f"/internal/jobs/{job_id}/result", json=outcome)
            assert_error(refused, 403, "forbidden")
            taken = second.post(f"/internal/jobs/{job_id}/result", json=outcome)
            assert taken.status_code == 200 and taken.json()["status"] == "failed"
            assert admin.get(f"/datasets/inspections/{job_id}").json()["status"] == "failed"


def test_owners_and_the_audit_trail_on_the_embedded_stack_s_sqlite(
    tmp_path: Path, tiny_workflow: WorkflowFactory
) -> None:
    workflow = tiny_workflow(phases=1, steps=4)
    home = tmp_path / "home"
    env = {"TRAINCTL_HOME": str(home), "TRAINCTL_DATA_ROOT": str(tmp_path / "data")}
    with processes() as procs:
        _, url = start_api(["up", "--workers", "0"], env=env, log=tmp_path / "up.log", procs=procs)
        assert stat.S_IMODE((home / "token").stat().st_mode) == 0o600
        assert stat.S_IMODE((home / "worker-token").stat().st_mode) == 0o600
        admin_token = (home / "token").read_text().strip()
        user_token = run_cli(["tokens", "create", "--name", "frank", "--role", "user"], env=env)
        with (
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30
            ) as admin,
            httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {user_token.strip()}"}, timeout=30
            ) as frank,
        ):
            admins_run = create_run(admin, workflow, "admin's")
            franks = create_run(frank, workflow, "frank's")
            assert frank.post(f"/runs/{franks}/pause").json()["status"] == "paused"
            assert_error(frank.post(f"/runs/{admins_run}/cancel"), 404, "run_not_found")
            assert [r["id"] for r in frank.get("/runs").json()["runs"]] == [franks]
            assert admin.get("/runs").json()["count"] == 2
            events = admin.get("/audit", params={"target_id": franks}).json()["events"]
            assert [(e["action"], e["actor_name"]) for e in events] == [
                ("run.pause", "frank"),
                ("run.create", "frank"),
            ]
            assert admin.get("/whoami").json()["name"] == "admin (embedded)"
