"""Token stores prepared ahead of time: POST /datasets/prepare -> outbox -> Redis -> a Celery
worker process -> the PreparedStore posted back; and `trainctl data prepare`, remote and local.

Real processes throughout: `trainctl serve` on a fresh Postgres database, a worker on Redis,
the shipped tokenizer. No eager mode, no mocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from procs import ROOT, Stack, cli, processes, run_cli
from test_jobs_e2e import TOKENIZER, submit, wait_for_job, write_summaries

from contracts.jobs import PreparedStore

pytestmark = pytest.mark.integration

PRETRAIN = ROOT / "examples" / "data" / "pretrain.eval.jsonl"
EXIT_BAD_INPUT = 2


def test_a_store_is_prepared_once_on_a_worker_and_by_the_cli(
    tmp_path: Path, postgres_url: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(TOKENIZER, data / "tokenizer.json")
    write_summaries(data / "summaries.jsonl", records=12)
    body = {
        "path": "summaries.jsonl",
        "tokenizer": "tokenizer.json",
        "objective": "summarization",
        "sequence_length": 64,
    }
    prepare = ["data", "prepare", "--tokenizer", str(TOKENIZER), "--sequence-length", "64"]

    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(data))
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        with stack.api() as api:
            missing = api.post("/datasets/prepare", json={**body, "path": "nowhere.jsonl"})
            assert missing.status_code == 422, missing.text
            assert [d["path"] for d in missing.json()["error"]["details"]] == ["path"]

            first = submit(api, "/datasets/prepare", body)
            stack.worker()
            job = wait_for_job(api, first, timeout=120, procs=procs)
            assert job["status"] == "succeeded", job
            built = PreparedStore.model_validate(job["result"])
            assert built.built is True
            assert (built.path, built.records) == (str(data / "summaries.jsonl"), 12)
            store = Path(built.store)
            assert store.parent == tmp_path / "artifacts" / "tokens"
            meta = json.loads((store / "meta.json").read_text())
            assert (meta["records"], meta["tokens"]) == (12, built.tokens)

            job = wait_for_job(api, submit(api, "/datasets/prepare", body), timeout=60, procs=procs)
            assert job["status"] == "succeeded", job
            again = PreparedStore.model_validate(job["result"])
            assert again.built is False
            assert (again.store, again.records, again.tokens) == (built.store, 12, built.tokens)

        # Remotely: a text file, unfitted as continued pretraining reads it, built on the worker.
        args = [*prepare, "--objective", "continued_pretrain", str(PRETRAIN)]
        remote = json.loads(run_cli([*args, "--remote", "--json"], env=env))
        assert remote["built"] is True and remote["store"].endswith("-raw")
        assert Path(remote["store"]).parent == tmp_path / "artifacts" / "tokens"
        shown = run_cli([*args, "--remote"], env={**env, "COLUMNS": "300"})
        assert f"store {remote['store']} already there" in shown
        failed = cli([*prepare, "--objective", "summarization", "--remote", "nowhere"], env=env)
        assert failed.returncode == 3 and "path" in failed.stderr

    # Locally, on the artifact store the worker used: the same key, so the same store, found.
    local = json.loads(run_cli([*args, "--json"], env=env))
    assert (local["store"], local["built"]) == (remote["store"], False)
    # And on a fresh one: built here, with the same content.
    fresh = {**env, "TRAINCTL_ARTIFACT_ROOT": str(tmp_path / "local")}
    shown = run_cli(args, env={**fresh, "COLUMNS": "300"})
    assert f"{remote['records']:,} records, {remote['tokens']:,} tokens" in shown
    assert str(tmp_path / "local" / "tokens" / Path(remote["store"]).name) in shown
    assert " built in " in shown
    missing_file = cli([*args[:-1], str(tmp_path / "nowhere.jsonl")], env=fresh)
    assert missing_file.returncode == EXIT_BAD_INPUT
    assert "nowhere.jsonl: file not found" in missing_file.stderr
