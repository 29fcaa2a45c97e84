"""Confined paths and checked checkpoints against a live server (`trainctl serve` on Postgres,
a `trainctl worker` on Redis): every path the API accepts must resolve inside
TRAINCTL_DATA_ROOTS (symlinks and `..` followed), an initial checkpoint must be safetensors
weights of the workflow's model, and a refused request stores nothing. The worker applies the
same rule to what a claim or a job gives it.

The hostile requests of issue 13: `/etc/passwd` as training data, `POST /datasets/inspect` on
`/etc/shadow`, `initial_checkpoint: "/etc/hostname"`, a link escaping a root, `..` escapes.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from exact import make_initial_checkpoint
from procs import ROOT, Proc, Stack, processes, short_demo_workflow, wait_for_run
from sqlalchemy import create_engine, text
from weights import write_weights_file

pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "examples"
TABLES = ("workflows", "runs", "attempts", "jobs", "outbox")


def refused(answer: httpx.Response, code: str = "path_outside_data_roots") -> dict[str, Any]:
    assert answer.status_code == 422, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert set(error) == {"code", "message", "details"}, error
    assert error["code"] == code, error
    return error


def stored(postgres_url: str) -> dict[str, int]:
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as connection:
            return {t: connection.scalar(text(f"SELECT count(*) FROM {t}")) for t in TABLES}
    finally:
        engine.dispose()


def with_data(doc: dict[str, Any], *paths: str) -> dict[str, Any]:
    """The workflow with `paths` added to its first phase's data (phases[0].data[1], ...)."""
    first = doc["phases"][0]
    extra = [{"path": p, "name": f"extra{i}"} for i, p in enumerate(paths)]
    return {**doc, "phases": [{**first, "data": first["data"] + extra}, *doc["phases"][1:]]}


def wait_for_job(api: httpx.Client, location: str, procs: list[Proc]) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(location).json()
        if job["status"] in ("succeeded", "failed"):
            return job
        for proc in procs:
            assert proc.popen.poll() is None, proc.tail()
        time.sleep(0.3)
    raise AssertionError(f"job {location} did not finish: {job}")


def test_paths_outside_the_data_roots_are_refused_and_nothing_is_stored(
    tmp_path: Path, postgres_url: str
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(EXAMPLES / "data" / "pretrain.eval.jsonl", data / "notes.jsonl")
    shutil.copy(EXAMPLES / "data" / "pretrain.eval.jsonl", outside / "secret.jsonl")
    (data / "passwd.jsonl").symlink_to("/etc/passwd")
    (data / "elsewhere").symlink_to(outside)
    roots = [str(data), str(EXAMPLES)]
    doc = short_demo_workflow()
    tokenizer = doc["tokenizer"]

    with processes() as procs:
        stack = Stack(
            tmp_path,
            postgres_url,
            procs,
            TRAINCTL_DATA_ROOTS=os.pathsep.join(roots),
            TRAINCTL_DATA_ROOT=str(data),
        )
        with stack.api() as api:
            before = stored(postgres_url)

            # /etc/passwd as training data: named at its JSON path, with the roots.
            for route in ("/workflows/validate", "/workflows"):
                error = refused(api.post(route, json=with_data(doc, "/etc/passwd")))
                [problem] = error["details"]
                assert problem["path"] == "phases[0].data[1].path"
                assert problem["value"] == "/etc/passwd"
                assert problem["roots"] == roots
                assert (
                    "phases[0].data[1].path: /etc/passwd is outside the data roots"
                    in (error["message"])
                )
                assert str(data) in error["message"] and str(EXAMPLES) in error["message"]
            error = refused(api.post("/runs", json={"workflow": with_data(doc, "/etc/passwd")}))
            assert error["details"][0]["path"] == "phases[0].data[1].path"

            # A link in a root pointing out, a folder linked out, `..` relative and absolute:
            # each refused at its own JSON path; the links are named with their targets.
            escapes = [
                str(data / "passwd.jsonl"),
                str(data / "elsewhere" / "secret.jsonl"),
                "passwd.jsonl",  # relative: resolved against the data root, link and all
                "../outside/secret.jsonl",
                "../../../../../../etc/passwd",
                f"{data}/../outside/secret.jsonl",
            ]
            error = refused(api.post("/runs", json={"workflow": with_data(doc, *escapes)}))
            paths = [p["path"] for p in error["details"]]
            assert paths == [f"phases[0].data[{i}].path" for i in range(1, 7)], error
            messages = [p["message"] for p in error["details"]]
            assert "resolves to /etc/passwd" in messages[0]
            assert f"resolves to {outside / 'secret.jsonl'}" in messages[1]
            # Of the tokenizer and an eval set too.
            wrong = {**doc, "tokenizer": "/etc/hostname"}
            wrong["evals"] = [{**doc["evals"][0], "data": "/etc/shadow"}]
            error = refused(api.post("/workflows/validate", json=wrong))
            assert [p["path"] for p in error["details"]] == ["tokenizer", "evals[0].data"]

            # An initial checkpoint outside (by path) is refused with the checkpoint roots.
            error = refused(
                api.post("/runs", json={"workflow": doc, "initial_checkpoint": "/etc/hostname"})
            )
            assert error["details"][0]["path"] == "initial_checkpoint"
            assert "/etc/hostname is outside the data roots" in error["message"]
            assert str(tmp_path / "artifacts" / "runs") in error["message"]

            # Jobs: inspection, preparation and evaluation.
            inspect = {
                "path": "/etc/shadow",
                "tokenizer": tokenizer,
                "objective": "continued_pretrain",
                "sequence_length": 64,
            }
            error = refused(api.post("/datasets/inspect", json=inspect))
            assert error["details"][0]["path"] == "path"
            assert "POST /datasets/inspect: path: /etc/shadow is outside" in error["message"]
            error = refused(
                api.post("/datasets/prepare", json={**inspect, "path": str(data / "passwd.jsonl")})
            )
            assert "resolves to /etc/passwd" in error["message"]
            error = refused(
                api.post(
                    "/datasets/inspect",
                    json={**inspect, "path": "notes.jsonl", "tokenizer": "/etc"},
                )
            )
            assert error["details"][0]["path"] == "tokenizer"
            evaluate = {
                "checkpoint": "/etc",
                "task": "summarization",
                "data": "notes.jsonl",
                "sequence_length": 64,
            }
            error = refused(api.post("/evaluations", json=evaluate))
            assert error["details"][0]["path"] == "checkpoint"

            assert stored(postgres_url) == before, "a refused request stores nothing"

            # Inside the roots, relative to the data root: accepted.
            inside = api.post("/datasets/inspect", json={**inspect, "path": "notes.jsonl"})
            assert inside.status_code == 202, inside.text
            assert inside.json()["request"]["path"] == str(data / "notes.jsonl")


def test_initial_checkpoints_are_checked_for_what_they_are(
    tmp_path: Path, postgres_url: str
) -> None:
    """At submission and at resume: a text file, a pickle, a truncated or corrupt safetensors
    file and weights of another model are 422 naming what is wrong; a save_pretrained directory
    of the workflow's model is taken."""
    doc = short_demo_workflow()
    config = doc["model"]["config"]  # vocab 512, hidden 64, 2 layers
    data = tmp_path / "data"
    data.mkdir()
    (data / "hostname").write_text("build-host-7\n")
    (data / "weights.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": [0.0]}))
    model = make_initial_checkpoint(data / "model", config)
    good = (model / "model.safetensors").read_bytes()
    (data / "truncated.safetensors").write_bytes(good[:-100])
    (data / "corrupt.safetensors").write_bytes(b"\xff" * 8 + good[8:])
    write_weights_file(data / "other-model.safetensors", vocab=512, hidden=32)
    bare = data / "bare"
    bare.mkdir()
    shutil.copy(model / "model.safetensors", bare / "model.safetensors")

    cases = {
        "hostname": "is not a safetensors file",
        "weights.bin": "is a pickle, not a safetensors file; trainctl never unpickles",
        "truncated.safetensors": "(truncated or corrupt)",
        "corrupt.safetensors": "is not a safetensors file",
        "other-model.safetensors": (
            "does not fit the workflow's model: model.embed_tokens.weight is [512, 32], "
            "the model's is [512, 64]"
        ),
        "bare": "is not a save_pretrained directory: it has no config.json",
    }
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(data))
        with stack.api() as api:
            before = stored(postgres_url)
            for name, said in cases.items():
                body = {"workflow": doc, "initial_checkpoint": name}
                error = refused(api.post("/runs", json=body), "invalid_initial_checkpoint")
                assert said in error["message"], (name, error)
                assert str(data / name) in error["message"], (name, error)
                assert error["details"]["path"] == str(data / name)
            assert stored(postgres_url) == before, "a refused request stores nothing"

            # A save_pretrained directory of the model: the run is created.
            created = api.post("/runs", json={"workflow": doc, "initial_checkpoint": "model"})
            assert created.status_code == 201, created.text
            run = created.json()
            assert run["initial_checkpoint"] == str(model)

            # Resume checks what it is given as well (before its signature): 422, not 409.
            error = refused(
                api.post(f"/runs/{run['id']}/resume", json={"initial_checkpoint": "hostname"}),
                "invalid_initial_checkpoint",
            )
            assert "is not a safetensors file" in error["message"]
            error = refused(
                api.post(f"/runs/{run['id']}/resume", json={"initial_checkpoint": "/etc/hostname"})
            )
            assert error["details"][0]["path"] == "initial_checkpoint"
            escape = {"initial_checkpoint": "../../../../../../etc/hostname"}
            refused(api.post(f"/runs/{run['id']}/resume", json=escape))
            assert len(api.get(f"/runs/{run['id']}").json()["attempts"]) == 1


def test_the_worker_refuses_what_its_own_roots_do_not_hold(
    tmp_path: Path, postgres_url: str
) -> None:
    """Defence in depth: a worker whose TRAINCTL_DATA_ROOTS are narrower than the service's
    refuses a claim's initial checkpoint and a job's file outside them before reading them,
    naming the path and its roots: the run fails with cause `config`, the job fails."""
    doc = short_demo_workflow()
    data = tmp_path / "data"
    model = make_initial_checkpoint(data / "model", doc["model"]["config"])
    shutil.copy(EXAMPLES / "data" / "pretrain.eval.jsonl", data / "notes.jsonl")
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(data))
        with stack.api() as api:
            created = api.post("/runs", json={"workflow": doc, "initial_checkpoint": "model"})
            assert created.status_code == 201, created.text
            inspect = {
                "path": "notes.jsonl",
                "tokenizer": doc["tokenizer"],
                "objective": "continued_pretrain",
                "sequence_length": 64,
            }
            answer = api.post("/datasets/inspect", json=inspect)
            assert answer.status_code == 202, answer.text

            worker = stack.worker(TRAINCTL_DATA_ROOTS=str(EXAMPLES))
            run = wait_for_run(api, created.json()["id"], timeout=120, procs=[worker])
            assert (run["status"], run["cause"], run["step"]) == ("failed", "config", 0), run
            message = run["attempts"][0]["message"]
            assert f"initial checkpoint: {model} is outside the data roots" in message, message
            assert str(EXAMPLES) in message
            job = wait_for_job(api, answer.headers["location"], [worker])
            assert job["status"] == "failed", job
            assert f"path: {data / 'notes.jsonl'} is outside the data roots" in job["error"], job
            assert api.get(f"/runs/{run['id']}/metrics").json() == {}, "no step was taken"
