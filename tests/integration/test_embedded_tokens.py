"""An admin cannot lock out the embedded stack by accident: rotating the token in the home's
`token` (the CLI's) or `worker-token` (the workers') rewrites the file, and the CLI and the
running workers go on with the new secret, no restart; revoking the token a request is made
with is refused unless asked for. Real processes: `trainctl up` (uvicorn, SQLite, the broker
folder) and its Celery worker child, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import cli, processes, run_cli, start_api, wait_until

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def live_worker_seen_after(api: httpx.Client, moment: str) -> dict[str, Any] | None:
    workers = api.get("/workers").json()["workers"]
    return next((w for w in workers if w["live"] and w["last_seen_at"] > moment), None)


def test_rotating_the_embedded_tokens_keeps_cli_and_workers_working(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {"TRAINCTL_HOME": str(home), "TRAINCTL_TORCH_THREADS": "1"}
    env["TRAINCTL_HEARTBEAT_SECONDS"] = "0.5"  # the workers' ping: seen within a second
    with processes() as procs:
        _, url = start_api(["up", "--workers", "1"], env=env, log=tmp_path / "up.log", procs=procs)
        # The CLI as a user of `up` runs it: no TRAINCTL_TOKEN, the token from the home.
        cli_env = {**env, "TRAINCTL_API_URL": url}
        first = (home / "token").read_text().strip()
        with httpx.Client(base_url=url, timeout=30) as api:
            auth = {"Authorization": f"Bearer {first}"}
            mine = api.get("/whoami", headers=auth).json()
            wait_until(
                lambda: api.get("/workers", headers=auth).json()["live"],
                timeout=180,
                what="the embedded worker to start",
            )
            tokens = {
                t["name"]: t
                for t in json.loads(run_cli(["tokens", "list", "--json"], env=cli_env))["tokens"]
            }
            worker_id = tokens["worker (embedded)"]["id"]

            # Revoking the token of the request itself: refused, in the error shape, saying why.
            refused = api.delete(f"/tokens/{mine['id']}", headers=auth)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "revoking_own_token"
            assert "allow_self=true" in refused.json()["error"]["message"]
            # The CLI refuses to revoke the token it uses itself, likewise.
            by_cli = cli(["tokens", "revoke", mine["id"]], env=cli_env)
            assert by_cli.returncode != 0 and "--allow-self" in by_cli.stderr, by_cli.stderr

            # Rotated through the API with itself: the file holds the new secret, the CLI works.
            rotated = api.post(f"/tokens/{mine['id']}/rotate", headers=auth)
            assert rotated.status_code == 200, rotated.text
            second = rotated.json()["secret"]
            assert (home / "token").read_text().strip() == second != first
            listed = json.loads(run_cli(["workers", "--json"], env=cli_env))
            assert listed["live"] == 1, listed

            # The workers' token rotated by the CLI: the file is rewritten and the running
            # worker's next ping and next job carry the new secret.
            old_worker = (home / "worker-token").read_text().strip()
            run_cli(["tokens", "rotate", worker_id], env=cli_env)
            assert (home / "worker-token").read_text().strip() != old_worker
            old = api.post(
                "/internal/workers/ping", headers={"Authorization": f"Bearer {old_worker}"}
            )
            assert old.status_code == 401
            admin = {"Authorization": f"Bearer {second}"}
            api.headers.update(admin)
            moment = api.get("/workers").json()["workers"][0]["last_seen_at"]
            wait_until(
                lambda: live_worker_seen_after(api, moment),
                timeout=30,
                what="a ping after rotation",
            )
            inspect = ["data", "inspect", str(EXAMPLES / "data" / "qa_rag.eval.jsonl"), "--remote"]
            inspect += ["--tokenizer", str(EXAMPLES / "tokenizer" / "tokenizer.json")]
            inspect += ["--objective", "qa_reasoning", "--sequence-length", "64", "--json"]
            inspected = cli(inspect, env=cli_env, timeout=180)
            assert json.loads(inspected.stdout)["records"] == 48, inspected.stderr

            # Asked for explicitly, a token revokes itself, and is refused from then on.
            revoked = api.delete(f"/tokens/{mine['id']}", params={"allow_self": "true"})
            assert revoked.status_code == 200 and revoked.json()["revoked_at"], revoked.text
            assert api.get("/whoami").status_code == 401
