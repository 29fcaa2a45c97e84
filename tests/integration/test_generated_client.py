"""A client generated from the live `/openapi.json` with openapi-python-client, as a dashboard
or notebook author would make one, drives a run end to end: create (and its replay), wait,
eval, metrics, CSV export, events, compare. Every answer the document gives a model for must
parse into that model (an attrs class, not a bare dict), so the document cannot drift from
what the server answers."""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import httpx
import pytest
from procs import Stack, processes, short_demo_workflow

from client.events import parse_events

pytestmark = pytest.mark.integration

PACKAGE = "trainctl_generated"
FINISHED = {"succeeded", "failed", "cancelled"}


def generate_client(document: Path, into: Path) -> ModuleType:
    """The generated package for `document`, written under `into` and imported from there."""
    from openapi_python_client import generate
    from openapi_python_client.config import Config, ConfigFile, MetaType
    from openapi_python_client.parser.errors import ErrorLevel

    config = Config.from_sources(
        ConfigFile(package_name_override=PACKAGE),
        MetaType.NONE,
        document,
        "utf-8",
        True,
        into / PACKAGE,
    )
    # Warnings only (ruff is not on PATH to format the code); an error leaves an endpoint out.
    problems = [e for e in generate(config=config) if e.level == ErrorLevel.ERROR]
    assert problems == [], [f"{e.header}: {e.detail}" for e in problems]
    sys.path.insert(0, str(into))
    return importlib.import_module(PACKAGE)


class Endpoints:
    """The generated module of each operation, found by its method and path in the document
    (openapi-python-client names a module after the operationId, under its first tag)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def __call__(self, method: str, path: str) -> ModuleType:
        from openapi_python_client.strings import PythonIdentifier

        operation = self.document["paths"].get(path, {}).get(method)
        assert operation is not None, f"{method.upper()} {path} is not in the document"
        tag = PythonIdentifier(operation["tags"][0], prefix="tag")
        module = PythonIdentifier(operation["operationId"], prefix="")
        return importlib.import_module(f"{PACKAGE}.api.{tag}.{module}")


@contextmanager
def part(failures: list[str], what: str) -> Iterator[None]:
    """One part of the walk through the document: its failure is noted and the walk goes on,
    so that the test names every part that does not hold, not only the first."""
    try:
        yield
    except Exception as err:  # any exception of a generated client is a finding
        failures.append(f"{what}: {type(err).__name__}: {str(err)[:300]}")


def typed(value: Any) -> bool:
    """An attrs class the generator made from a schema of the document, not a bare dict."""
    return attrs.has(type(value))


def test_a_client_generated_from_the_live_document_drives_a_run_end_to_end(
    tmp_path: Path, postgres_url: str
) -> None:
    workflow = short_demo_workflow(pretrain_steps=4, sft_steps=2)
    failures: list[str] = []
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs)
        stack.worker()
        document = httpx.get(f"{stack.url}/openapi.json", timeout=30).json()
        (tmp_path / "openapi.json").write_text(json.dumps(document))
        generated = generate_client(tmp_path / "openapi.json", tmp_path / "generated")
        models = importlib.import_module(f"{PACKAGE}.models")
        endpoint = Endpoints(document)
        api = generated.AuthenticatedClient(
            base_url=stack.url, token=stack.admin, raise_on_unexpected_status=True, timeout=60
        )

        # Create: two runs of one workflow (compare needs two), the first with a key.
        create = endpoint("post", "/runs")
        body = models.RunCreate.from_dict({"workflow": workflow, "name": "first"})
        created = create.sync_detailed(client=api, body=body, idempotency_key="gen-1")
        assert created.status_code == 201 and typed(created.parsed), created
        run_id = created.parsed.id
        second = create.sync(
            client=api, body=models.RunCreate.from_dict({"workflow": workflow, "name": "second"})
        )
        assert typed(second), second

        with part(failures, "POST /runs replayed with its Idempotency-Key answers 200 RunPublic"):
            again = create.sync_detailed(client=api, body=body, idempotency_key="gen-1")
            assert again.status_code == 200 and typed(again.parsed)
            assert again.parsed.id == run_id
        with part(failures, "POST /workflows of a stored document answers 200 WorkflowPublic"):
            store = endpoint("post", "/workflows")
            # The document as the schema describes it (a model), or as today's `Any` body.
            doc = models.Workflow.from_dict(workflow) if hasattr(models, "Workflow") else workflow
            stored = store.sync_detailed(client=api, body=doc)
            assert stored.status_code == 200 and typed(stored.parsed), stored

        # Wait: poll the run until both are finished.
        read_run = endpoint("get", "/runs/{run_id}")
        deadline = time.monotonic() + 300
        for rid in (run_id, second.id):
            while (run := read_run.sync(rid, client=api)).status not in FINISHED:
                assert time.monotonic() < deadline, f"run {rid} still {run.status}"
                time.sleep(0.5)
            assert typed(run) and run.status == "succeeded", run

        with part(failures, "GET /runs/{id}/eval parses into EvalSummaryPublic"):
            evals = endpoint("get", "/runs/{run_id}/eval").sync(run_id, client=api)
            assert typed(evals), type(evals)
            summary = evals.tasks.additional_properties
            assert summary and all(typed(s.latest) for s in summary.values())
        with part(failures, "GET /runs/{id}/eval/phases parses into EvalByPhase"):
            matrix = endpoint("get", "/runs/{run_id}/eval/phases").sync(run_id, client=api)
            assert typed(matrix) and len(matrix.phases) == len(workflow["phases"])
        with part(failures, "GET /runs/{id}/metrics parses into MetricSeriesPublic"):
            metrics = endpoint("get", "/runs/{run_id}/metrics").sync(run_id, client=api)
            assert typed(metrics), type(metrics)
            loss = metrics.additional_properties["loss"]
            assert typed(loss) and loss.steps[-1] == run.total_steps
        with part(failures, "GET /runs/{id}/metrics.csv answers text/csv as a string"):
            csv = endpoint("get", "/runs/{run_id}/metrics.csv").sync_detailed(run_id, client=api)
            assert csv.status_code == 200 and isinstance(csv.parsed, str)
            assert csv.parsed.splitlines()[0] == "run_id,name,step,value"
        with part(failures, "GET /runs/{id}/eval.csv answers text/csv as a string"):
            csv = endpoint("get", "/runs/{run_id}/eval.csv").sync_detailed(run_id, client=api)
            assert csv.status_code == 200 and isinstance(csv.parsed, str)
            assert csv.parsed.startswith("run_id,name,task,step,phase,")
        with part(failures, "GET /runs/{id}/events answers text/event-stream as a string"):
            stream = endpoint("get", "/runs/{run_id}/events").sync_detailed(run_id, client=api)
            assert stream.status_code == 200 and isinstance(stream.parsed, str)
            events = list(parse_events(stream.parsed.splitlines()))
            assert events[0].name == "run" and events[-1].name == "end"
            assert events[-1].data == {"status": "succeeded"}
        with part(failures, "GET /runs/compare parses into RunComparison"):
            compared = endpoint("get", "/runs/compare").sync(
                client=api, ids=f"{run_id},{second.id}"
            )
            assert typed(compared) and [r.id for r in compared.runs] == [run_id, second.id]
            assert compared.inputs.identical, "two runs of one workflow train on the same inputs"
        with part(failures, "GET /runs/{id}/checkpoints and /ledger parse into their models"):
            checkpoints = endpoint("get", "/runs/{run_id}/checkpoints").sync(run_id, client=api)
            ledger = endpoint("get", "/runs/{run_id}/ledger").sync(run_id, client=api)
            assert typed(checkpoints) and checkpoints.count >= 1 and typed(ledger)
        with part(failures, "GET /runs parses into RunsPublic"):
            runs = endpoint("get", "/runs").sync(client=api)
            assert typed(runs) and {r.id for r in runs.runs} == {run_id, second.id}

    assert failures == [], "\n".join(failures)
