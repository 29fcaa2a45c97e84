"""A run's inputs in an object store (issue 25), with the service holding no artifact disk:
`s3://` tokenizer and data are hashed by workers' `digest` jobs (the service only HEADs and
lists them), POST /runs answers 409 `inputs_being_hashed` naming the jobs until their digests
are known, and another run's checkpoint in the bucket's runs/ is an initial checkpoint whose
digest comes from its manifest and whose weights are checked by range reads.

All against the loopback S3 server (its HTTP API only), real Postgres, and for the digest
itself a real worker process.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from procs import Stack, processes
from sqlalchemy import create_engine, select
from test_leases import Claimant
from weights import weights_bytes

from contracts.signature import sha256_path
from runtime.store import open_store
from service.models import InputDigest, Job, Run

if TYPE_CHECKING:
    from conftest import S3, Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration

TOKENIZER = json.dumps({"model": {"type": "BPE"}}).encode()
PRETRAIN = b'{"text": "the quick brown fox"}\n'
SUMMARIES = b'{"source": "a long text", "target": "short"}\n'


def put(s3: S3, key: str, data: bytes) -> None:
    store = open_store(f"s3://{s3.bucket}")
    store.put_bytes(key, data)


def s3_workflow(tiny_workflow: WorkflowFactory, s3: S3, **paths: str) -> dict[str, Any]:
    """tiny_workflow (one phase) over a tokenizer directory and data objects in the bucket."""
    put(s3, "data/tok/tokenizer.json", TOKENIZER)
    put(s3, "data/tok/special.txt", b"<s>\n")
    put(s3, "data/pretrain.jsonl", PRETRAIN)
    put(s3, "data/summaries.jsonl", SUMMARIES)
    doc = tiny_workflow(phases=1)
    doc["tokenizer"] = paths.get("tokenizer", s3.uri("data/tok"))
    doc["phases"][0]["data"] = [{"path": paths.get("data", s3.uri("data/pretrain.jsonl"))}]
    doc["evals"][0]["data"] = s3.uri("data/summaries.jsonl")
    return doc


def tokenizer_digest() -> str:
    """sha256_path's rule for the tokenizer prefix, from its bytes."""
    lines = [
        f"special.txt\0{hashlib.sha256(b'<s>' + bytes([10])).hexdigest()}\n",
        f"tokenizer.json\0{hashlib.sha256(TOKENIZER).hexdigest()}\n",
    ]
    return hashlib.sha256("".join(sorted(lines)).encode()).hexdigest()


@pytest.fixture
def s3_api(make_settings: SettingsFactory, make_api: ApiFactory, s3: S3, tmp_path: Path) -> Api:
    return make_api(
        make_settings(
            artifact_root=s3.root,
            data_roots=(str(tmp_path / "data"), s3.uri("data")),
            digest_wait_seconds=0,
            reaper_interval_seconds=3600,
        )
    )


def test_unknown_object_digests_are_jobs_a_failed_one_names_its_input_and_roots_hold(
    s3_api: Api, s3: S3, tiny_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    api = s3_api
    doc = s3_workflow(tiny_workflow, s3)
    answer = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "inputs_being_hashed"
    named = {i["field"]: i for i in error["details"]["inputs"]}
    data_field = f'data["{s3.uri("data/pretrain.jsonl")}"]'
    eval_field = f'data["{s3.uri("data/summaries.jsonl")}"]'
    assert set(named) == {"tokenizer", data_field, eval_field}
    assert named["tokenizer"]["uri"] == s3.uri("data/tok")
    with api.sessions() as session:
        jobs = {j.id: j for j in session.scalars(select(Job).where(Job.kind == "digest"))}
    assert set(jobs) == {i["job_id"] for i in named.values()}
    assert jobs[named["tokenizer"]["job_id"]].request["uri"] == s3.uri("data/tok")

    # Asked again: the same jobs, none new.
    again = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert again.status_code == 409
    assert {i["job_id"] for i in again.json()["error"]["details"]["inputs"]} == set(jobs)

    # A worker that cannot read the object fails the job: 422 naming the input, and the next
    # request asks a worker again.
    failing = named[data_field]["job_id"]
    started = api.client.post(f"/internal/jobs/{failing}/start", headers=api.worker)
    assert started.status_code == 200, started.text
    outcome = {"status": "failed", "error": "access denied to data/pretrain.jsonl"}
    posted = api.client.post(f"/internal/jobs/{failing}/result", json=outcome, headers=api.worker)
    assert posted.status_code == 200, posted.text
    refused = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert refused.status_code == 422, refused.text
    body = refused.json()["error"]
    assert body["code"] == "missing_input"
    assert [p["path"] for p in body["details"]] == [data_field]
    assert "access denied" in body["message"] and failing in body["message"]
    retried = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert retried.status_code == 409
    renamed = {i["field"]: i["job_id"] for i in retried.json()["error"]["details"]["inputs"]}
    assert renamed[data_field] != failing
    assert renamed["tokenizer"] == named["tokenizer"]["job_id"]

    # An object outside the data roots is refused before anything is read or asked.
    outside = s3_workflow(tiny_workflow, s3, data=s3.uri("elsewhere/pretrain.jsonl"))
    answer = api.client.post("/runs", json={"workflow": outside}, headers=api.admin)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "path_outside_data_roots"
    assert answer.json()["error"]["details"][0]["path"] == "phases[0].data[0].path"
    # Nothing under a data root URI: the service's listing says so, no job is made.
    missing = s3_workflow(tiny_workflow, s3, data=s3.uri("data/nothing-here.jsonl"))
    answer = api.client.post("/runs", json={"workflow": missing}, headers=api.admin)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "missing_input"
    assert "nothing-here.jsonl" in answer.json()["error"]["message"]
    # A save_pretrained prefix as initial checkpoint: its weights checked by range reads (a
    # wrong shape refused), then hashed by a worker like any input.
    config = json.dumps({"model_type": "llama"}).encode()
    put(s3, "data/model/config.json", config)
    put(s3, "data/model/model.safetensors", weights_bytes("m"))
    put(s3, "data/small/config.json", config)
    put(s3, "data/small/model.safetensors", weights_bytes("s", vocab=64))
    local = tiny_workflow(phases=1)
    body = {"workflow": local, "initial_checkpoint": s3.uri("data/small")}
    answer = api.client.post("/runs", json=body, headers=api.admin)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "invalid_initial_checkpoint"
    assert "[64, 4], the model's is [256, ?]" in answer.json()["error"]["message"]
    body = {"workflow": local, "initial_checkpoint": s3.uri("data/model")}
    answer = api.client.post("/runs", json=body, headers=api.admin)
    assert answer.status_code == 409, answer.text
    asked = answer.json()["error"]["details"]["inputs"]
    assert [(i["field"], i["uri"]) for i in asked] == [("initial_checkpoint", s3.uri("data/model"))]
    # The service has no artifact folder, and made none.
    assert not (tmp_path / "artifacts").exists()


def lay_out_checkpoint(
    s3: S3, tmp: Path, run_id: str, step: int, files: dict[str, bytes]
) -> tuple[str, str]:
    """A checkpoint in the remote layout in the bucket (files under a save id, the manifest
    last); its URI and the digest sha256_path gives for its downloaded directory."""
    uri = f"{s3.root}/runs/{run_id}/checkpoints/step-{step:08d}"
    store = open_store(s3.root)
    base = f"runs/{run_id}/checkpoints/step-{step:08d}"
    save = f"save-{step}-abc"
    for name, data in files.items():
        store.put_bytes(f"{base}/{save}/{name}", data)
    manifest = {
        "step": step,
        "save": save,
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            for name, data in files.items()
        },
    }
    raw = json.dumps(manifest, indent=1).encode()
    assert store.put_bytes(f"{base}/manifest.json", raw, create=True)
    # What a worker's download of it is: the files and the manifest, byte for byte.
    local = tmp / f"download-{step}"
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    (local / "manifest.json").write_bytes(raw)
    return uri, sha256_path(local)


def test_a_checkpoint_in_the_bucket_is_an_initial_checkpoint_by_its_manifest(
    s3_api: Api, s3: S3, tiny_workflow: WorkflowFactory, tmp_path: Path
) -> None:
    api = s3_api
    local = tiny_workflow(phases=1)  # local inputs: hashed here as ever
    created = api.client.post("/runs", json={"workflow": local}, headers=api.admin)
    assert created.status_code == 201, created.text
    source = created.json()
    worker = Claimant(api, source["attempts"][0]["id"], api.worker, nonce="n")
    assert worker.claim().status_code == 200
    assert worker.claimed["artifact_dir"] == f"{s3.root}/runs/{source['id']}"

    config = json.dumps({"model_type": "llama", "vocab_size": 256}).encode()
    fits = {"config.json": config, "model.safetensors": weights_bytes("ten"), "rng.pt": b"r"}
    uri, digest = lay_out_checkpoint(s3, tmp_path, source["id"], 10, fits)
    small = {"config.json": config, "model.safetensors": weights_bytes("x", vocab=128)}
    small_uri, _ = lay_out_checkpoint(s3, tmp_path, source["id"], 5, small)
    for step in (5, 10):
        answer = worker.checkpoint(step)
        assert answer.status_code == 200, answer.text

    for given in ({"run": source["id"], "step": 10}, uri):
        body = {"workflow": local, "initial_checkpoint": given}
        answer = api.client.post("/runs", json=body, headers=api.admin)
        assert answer.status_code == 201, answer.text
        with api.sessions() as session:
            run = session.get(Run, answer.json()["id"])
            assert run is not None
            stored = run.signature_components["initial_checkpoint"]
            assert (stored["path"], stored["sha256"]) == (uri, digest)
            assert (stored["run"], stored["step"]) == (source["id"], 10)
            assert run.initial_checkpoint == uri

    body = {"workflow": local, "initial_checkpoint": {"run": source["id"], "step": 5}}
    refused = api.client.post("/runs", json=body, headers=api.admin)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_initial_checkpoint"
    assert error["details"]["path"] == small_uri
    assert "model.safetensors" in error["message"]
    assert "[128, 4], the model's is [256, ?]" in error["message"]
    assert not (tmp_path / "artifacts").exists()


def wait_for_run(client: httpx.Client, body: dict[str, Any], timeout: float) -> httpx.Response:
    """POST /runs until it is no longer 409 inputs_being_hashed."""
    deadline = time.monotonic() + timeout
    while True:
        answer = client.post("/runs", json=body)
        if answer.status_code != 409 or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def test_a_worker_hashes_objects_for_the_service_and_a_changed_object_is_hashed_again(
    tmp_path: Path, postgres_url: str, s3: S3, tiny_workflow: WorkflowFactory
) -> None:
    doc = s3_workflow(tiny_workflow, s3)
    # On two devices: the run stays queued on a queue no one-device worker serves, so the
    # worker is free for digest jobs.
    doc["resources"] = {"devices": 2}
    doc["phases"][0]["grad_accum"] = 2
    engine = create_engine(postgres_url)
    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_ARTIFACT_ROOT=s3.root,
            TRAINCTL_DATA_ROOTS=f"{tmp_path}:{s3.uri('data')}",
            TRAINCTL_DIGEST_WAIT_SECONDS="0",
            **s3.env,
        )
        with stack.api() as api:
            first = api.post("/runs", json={"workflow": doc})
            assert first.status_code == 409, first.text
            jobs = {i["field"]: i["job_id"] for i in first.json()["error"]["details"]["inputs"]}
            stack.worker(TRAINCTL_CACHE_DIR=str(tmp_path / "cache"))

            answer = wait_for_run(api, {"workflow": doc}, timeout=180)
            assert answer.status_code == 201, answer.text
            with engine.connect() as db:
                components = db.execute(
                    select(Run.signature_components).where(Run.id == answer.json()["id"])
                ).scalar_one()
                hashed = dict(db.execute(select(InputDigest.uri, InputDigest.sha256)).all())
            assert components["tokenizer"]["sha256"] == tokenizer_digest()
            pretrain, summaries = s3.uri("data/pretrain.jsonl"), s3.uri("data/summaries.jsonl")
            assert components["data"][pretrain]["sha256"] == hashlib.sha256(PRETRAIN).hexdigest()
            assert components["data"][summaries]["sha256"] == hashlib.sha256(SUMMARIES).hexdigest()
            assert hashed[pretrain] == hashlib.sha256(PRETRAIN).hexdigest()

            # The object rewritten (a new ETag): a new job for it alone, then its new digest.
            changed = b'{"text": "the slow green turtle"}\n'
            put(s3, "data/pretrain.jsonl", changed)
            again = api.post("/runs", json={"workflow": doc})
            assert again.status_code == 409, again.text
            asked = again.json()["error"]["details"]["inputs"]
            assert [i["field"] for i in asked] == [f'data["{pretrain}"]']
            assert asked[0]["job_id"] not in jobs.values()
            answer = wait_for_run(api, {"workflow": doc}, timeout=120)
            assert answer.status_code == 201, answer.text
            with engine.connect() as db:
                components = db.execute(
                    select(Run.signature_components).where(Run.id == answer.json()["id"])
                ).scalar_one()
            assert components["data"][pretrain]["sha256"] == hashlib.sha256(changed).hexdigest()
    engine.dispose()
    assert not (tmp_path / "artifacts").exists()
