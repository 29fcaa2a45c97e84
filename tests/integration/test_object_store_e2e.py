"""A fleet with no shared filesystem: the artifact store is a bucket on an S3 server (moto in
server mode, on loopback, spoken to over HTTP), and each worker has a home of its own.

A worker SIGKILLed mid-phase, the run resumed by another worker that has never seen its disk:
the second downloads only the checkpoint it resumes from and ends bit-identical to an
uninterrupted run. A crash between the upload of a save's files and its manifest leaves no
checkpoint, and the next attempt collects the files. Retention deletes objects.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import torch
from exact import differences, ledger_phases, series, shard_tensors, workflow
from procs import Proc, Stack, processes, resume_when_lease_lapses, wait_for_run, wait_until
from safetensors.torch import load_file

from runtime.store import open_store
from worker.remote.checkpoints import RemoteCheckpoints

if TYPE_CHECKING:
    from conftest import S3

pytestmark = pytest.mark.integration

SERVICE_ENV = {"TRAINCTL_LEASE_SECONDS": "3", "TRAINCTL_REAPER_INTERVAL_SECONDS": "3600"}
WORKER_ENV = {"TRAINCTL_HEARTBEAT_SECONDS": "0.5"}


def s3_stack(tmp_path: Path, postgres_url: str, procs: list[Proc], s3: S3) -> Stack:
    return Stack(
        tmp_path, postgres_url, procs, **SERVICE_ENV, **s3.env, TRAINCTL_ARTIFACT_ROOT=s3.root
    )


def host(stack: Stack, name: str, **env: str) -> Proc:
    """A worker on a machine of its own: its home (and so its cache) shared with no one."""
    return stack.worker(**WORKER_ENV, TRAINCTL_HOME=str(stack.tmp_path / name), **env)


def final_state(run: dict[str, Any], into: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The run's final weights and optimizer state, downloaded from the store."""
    latest = run["latest_checkpoint"]
    assert latest["path"].startswith("s3://"), latest
    assert latest["step"] == run["total_steps"]
    run_dir = latest["path"].rsplit("/checkpoints/", 1)[0]
    local = RemoteCheckpoints(run_dir).fetch(latest["step"], into / run["id"])
    optimizer = torch.load(local / "optimizer.pt", weights_only=True)
    return load_file(local / "model.safetensors"), optimizer


def cached_steps(home: Path, run_id: str) -> list[str]:
    folder = home / "cache" / "runs" / run_id / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("failpoint", ["after_checkpoint@4", "mid_upload@8"])
def test_another_host_resumes_from_the_store_bit_identical(
    tmp_path: Path, postgres_url: str, s3: S3, failpoint: str
) -> None:
    body = {"workflow": workflow("continued_pretrain")}
    with processes() as procs:
        stack = s3_stack(tmp_path, postgres_url, procs, s3)
        with stack.api() as api:
            doomed = host(stack, "host-a", TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS=failpoint)
            created = api.post("/runs", json=body)
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
            remote = RemoteCheckpoints(f"{s3.root}/runs/{run_id}")
            prefix = f"runs/{run_id}/checkpoints/step-00000008"
            store = open_store(s3.root)
            if failpoint.startswith("mid_upload"):
                # Its files are up, its manifest is not: no checkpoint of step 8 exists.
                assert remote.steps() == [4]
                assert [i.key for i in store.list(prefix)], "the save's files were uploaded"

            survivor = host(stack, "host-b")
            resume_when_lease_lapses(api, run_id)
            resumed = wait_for_run(api, run_id, timeout=300, procs=[survivor])
            assert resumed["status"] == "succeeded", resumed
            # It downloaded the one checkpoint it resumed from, nothing else.
            log = survivor.log.read_text().splitlines()
            downloads = [line for line in log if "downloaded checkpoint" in line]
            assert len(downloads) == 1 and "step-00000004" in downloads[0], downloads
            # Its cache holds what it staged: retention keeps only the newest local copy.
            assert cached_steps(tmp_path / "host-b", run_id) == ["step-00000012"]
            reference = wait_for_run(
                api, api.post("/runs", json=body).json()["id"], timeout=300, procs=[survivor]
            )
            assert reference["status"] == "succeeded", reference

            weights, optimizer = final_state(resumed, tmp_path / "downloads")
            ref_weights, ref_optimizer = final_state(reference, tmp_path / "downloads")
            assert differences(weights, ref_weights) == []
            assert differences(optimizer, ref_optimizer) == []
            assert series(api, run_id) == series(api, reference["id"])
            assert ledger_phases(api, run_id) == ledger_phases(api, reference["id"])

            # Retention (keep_last 2) deleted step 4's objects; what remains is committed.
            assert remote.steps() == [12, 8]
            assert not [i.key for i in store.list(f"runs/{run_id}/checkpoints/step-00000004")]
            listed = api.get(f"/runs/{run_id}/checkpoints").json()
            usable = [c["step"] for c in listed["checkpoints"] if c["status"] == "usable"]
            assert all(c["path"].startswith(s3.root) for c in listed["checkpoints"])
            assert sorted(usable) == [8, 12], listed
            # Every object under a step belongs to the save its manifest names: the killed
            # writer's uploads were collected.
            for step in (8, 12):
                save = remote.manifest(step)["save"]
                keys = [i.key for i in store.list(f"runs/{run_id}/checkpoints/step-{step:08d}")]
                assert all(k.endswith("manifest.json") or f"/{save}/" in k for k in keys), keys
            # No worker wrote under another's home, and nothing under the service's.
            assert not (tmp_path / "home" / "artifacts").exists()
            manifest = json.loads(
                store.get_bytes(f"runs/{run_id}/checkpoints/step-00000012/manifest.json")
            )
            assert "model.safetensors" in manifest["files"]


def test_a_sharded_phase_checkpoints_to_the_store_and_another_host_resumes_it(
    tmp_path: Path, postgres_url: str, s3: S3
) -> None:
    """FSDP over two ranks on host A: its shards go up with the rest of each checkpoint. Host A
    is lost whole (every process SIGKILLed) after the step-4 checkpoint; host B, sharing no disk
    with it, downloads that checkpoint, reads the shards back and ends bit-identical to an
    uninterrupted run, shards included."""
    doc = workflow("continued_pretrain")
    doc["phases"][0]["grad_accum"] = 2  # one microbatch a rank, the same global batch
    doc["phases"][0]["resources"] = {"devices": 2, "sharding": "fsdp"}
    body = {"workflow": doc}
    ranks = {"TRAINCTL_DEVICES": "2", "TRAINCTL_COLLECTIVE_TIMEOUT_SECONDS": "60"}
    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_LEASE_SECONDS="8",
            TRAINCTL_REAPER_INTERVAL_SECONDS="1",
            **s3.env,
            TRAINCTL_ARTIFACT_ROOT=s3.root,
        )
        with stack.api() as api:
            lost = host(stack, "host-a", **ranks)
            created = api.post("/runs", json=body)
            assert created.status_code == 201, created.text
            run_id = created.json()["id"]
            remote = RemoteCheckpoints(f"{s3.root}/runs/{run_id}")
            wait_until(lambda: 4 in remote.steps(), timeout=240, what="the step-4 checkpoint")
            os.killpg(lost.pid, signal.SIGKILL)  # the machine is gone, ranks and all
            lost.popen.wait(timeout=30)

            survivor = host(stack, "host-b", **ranks)
            resumed = wait_for_run(api, run_id, timeout=300, procs=[survivor])
            assert resumed["status"] == "succeeded", resumed
            assert resumed["attempts"][0]["status"] == "lost", resumed["attempts"]
            reference = wait_for_run(
                api, api.post("/runs", json=body).json()["id"], timeout=300, procs=[survivor]
            )
            assert reference["status"] == "succeeded", reference

            downloads = tmp_path / "downloads"
            weights, optimizer = final_state(resumed, downloads)
            ref_weights, ref_optimizer = final_state(reference, downloads)
            assert differences(weights, ref_weights) == []
            assert differences(optimizer, ref_optimizer) == []
            assert series(api, run_id) == series(api, reference["id"])
            shards = shard_tensors(downloads / run_id / "step-00000012")
            ref_shards = shard_tensors(downloads / reference["id"] / "step-00000012")
            assert shards and differences(shards, ref_shards) == []
            files = remote.manifest(8)["files"]
            assert isinstance(files, dict)
            assert {"shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(files)


def test_a_pinned_checkpoint_in_the_store_outlives_retention_and_starts_another_run(
    tmp_path: Path, postgres_url: str, s3: S3
) -> None:
    """Run B starts from run A's step-4 checkpoint in the bucket: the service signs it by its
    manifest alone (the worker's hash of its download must agree, or B refuses to train), A's
    retention keeps it while B needs it, and B trains from it on a host that never saw A."""
    body = {"workflow": workflow("continued_pretrain")}
    with processes() as procs:
        stack = s3_stack(tmp_path, postgres_url, procs, s3)
        with stack.api() as api:
            doomed = host(
                stack, "host-a", TRAINCTL_TESTING="1", TRAINCTL_TEST_FAILPOINTS="after_checkpoint@4"
            )
            created = api.post("/runs", json=body)
            assert created.status_code == 201, created.text
            source = created.json()["id"]
            assert doomed.popen.wait(timeout=180) == -signal.SIGKILL, doomed.tail()
            remote = RemoteCheckpoints(f"{s3.root}/runs/{source}")
            assert remote.steps() == [4]

            tuned_body = {
                "workflow": workflow("continued_pretrain", steps=4),
                "initial_checkpoint": {"run": source, "step": 4},
            }
            tuned = api.post("/runs", json=tuned_body)
            assert tuned.status_code == 201, tuned.text
            tuned_id = tuned.json()["id"]
            assert api.post(f"/runs/{tuned_id}/pause").json()["status"] == "paused"
            # The same checkpoint by its URI is the same reference, and the same content.
            by_uri = api.post(
                "/runs", json={**tuned_body, "initial_checkpoint": remote.uri(4)}
            ).json()
            assert by_uri["signature"] == tuned.json()["signature"], by_uri
            api.post(f"/runs/{by_uri['id']}/cancel")

            survivor = host(stack, "host-b")
            resume_when_lease_lapses(api, source)
            done = wait_for_run(api, source, timeout=300, procs=[survivor])
            assert done["status"] == "succeeded", done
            # keep_last 2 keeps 8 and 12; step 4 stays because run B is pinned to it.
            assert remote.steps() == [12, 8, 4]
            usable = api.get(f"/runs/{source}/checkpoints").json()["checkpoints"]
            assert sorted(c["step"] for c in usable) == [4, 8, 12]

            assert api.post(f"/runs/{tuned_id}/resume").status_code == 200
            finished = wait_for_run(api, tuned_id, timeout=300, procs=[survivor])
            assert finished["status"] == "succeeded", finished
            assert finished["signature"] == tuned.json()["signature"]


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_jobs_and_a_run_read_their_inputs_from_the_bucket(
    tmp_path: Path, postgres_url: str, s3: S3
) -> None:
    """Data and tokenizer only in the bucket: a preparation job on host A builds the token
    store and publishes it; a run over the same objects (signed by a worker's digest job, the
    API reads no byte of them) trains on host B, which downloads that store instead of
    encoding the corpus again; inspection and an evaluation of the run's checkpoint in the
    bucket read objects too."""
    bucket = open_store(f"s3://{s3.bucket}")
    inputs = {
        "data/tokenizer.json": EXAMPLES / "tokenizer" / "tokenizer.json",
        "data/pretrain.jsonl": EXAMPLES / "data" / "pretrain.train.jsonl",
        "data/summaries.jsonl": EXAMPLES / "data" / "summarization.eval.jsonl",
    }
    for key, path in inputs.items():
        bucket.put_file(key, path)
    tokenizer, corpus, summaries = (s3.uri(key) for key in inputs)
    doc = workflow("continued_pretrain", steps=4)
    doc["tokenizer"] = tokenizer
    doc["phases"][0]["data"][0]["path"] = corpus
    doc["evals"] = []
    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            **SERVICE_ENV,
            **s3.env,
            TRAINCTL_ARTIFACT_ROOT=s3.root,
            TRAINCTL_DATA_ROOTS=f"{tmp_path}:{s3.uri('data')}",
        )
        with stack.api() as api:
            host_a = host(stack, "host-a")
            phase = doc["phases"][0]
            prepare = {
                "path": corpus,
                "tokenizer": tokenizer,
                "objective": "continued_pretrain",
                "sequence_length": phase["sequence_length"],
            }
            job = job_result(api, "/datasets/prepare", prepare, procs=[host_a])
            assert job["result"]["path"] == corpus, job
            assert [i for i in bucket.list("artifacts/tokens") if i.key.endswith("manifest.json")]
            inspected = job_result(
                api,
                "/datasets/inspect",
                {
                    "path": summaries,
                    "tokenizer": tokenizer,
                    "objective": "summarization",
                    "sequence_length": 128,
                },
                procs=[host_a],
            )
            assert inspected["result"]["path"] == summaries
            assert inspected["result"]["records"] == 48
            host_a.stop()

            host_b = host(stack, "host-b")
            created = api.post("/runs", json={"workflow": doc})
            assert created.status_code == 201, created.text  # the digest job ran meanwhile
            run = wait_for_run(api, created.json()["id"], timeout=300, procs=[host_b])
            assert run["status"] == "succeeded", run
            log = host_b.log.read_text()
            assert "downloaded token store" in log, log[-3000:]
            assert "published token store" not in log

            evaluation = job_result(
                api,
                "/evaluations",
                {
                    "checkpoint": run["latest_checkpoint"]["path"],
                    "task": "summarization",
                    "data": summaries,
                    "tokenizer": tokenizer,
                    "sequence_length": 128,
                    "batch_size": 4,
                },
                procs=[host_b],
            )
            result = evaluation["result"]
            assert result["records"] > 0 and result["cross_entropy"] > 0, result


def job_result(
    api: httpx.Client, route: str, body: dict[str, Any], *, procs: list[Proc]
) -> dict[str, Any]:
    answer = api.post(route, json=body)
    assert answer.status_code == 202, answer.text
    location = answer.headers["location"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(location).json()
        if job["status"] in ("succeeded", "failed"):
            assert job["status"] == "succeeded", job
            return job
        assert all(p.alive() for p in procs), [p.tail() for p in procs]
        time.sleep(0.3)
    raise AssertionError(f"{route} did not finish: {job}")
