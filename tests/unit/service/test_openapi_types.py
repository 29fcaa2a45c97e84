"""The OpenAPI document types what the service answers and takes: a client generated from it
reads every JSON answer into a model, sends a workflow it can check before sending, and reads
every time as a date-time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from fastapi import FastAPI

from contracts.workflow import Workflow
from service.api.app import create_app
from service.settings import ServiceSettings

REF = "#/components/schemas/"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("openapi")
    app: FastAPI = create_app(
        ServiceSettings(home=home / "home", data_root=home, broker_url="memory://")
    )
    return app.openapi()


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].removeprefix(REF)]
    return schema


def _json_answers(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                content = response.get("content", {})
                # A CSV or event-stream answer is not JSON: it is declared as what it is.
                if status.startswith("2") and (not content or "application/json" in content):
                    yield f"{method.upper()} {path} {status}", content.get("application/json", {})


def test_every_json_answer_has_a_model(document: dict[str, Any]) -> None:
    untyped = []
    for name, media in _json_answers(document):
        schema = _resolve(document, media.get("schema", {}))
        if not schema.get("properties") and not isinstance(
            schema.get("additionalProperties"), dict
        ):
            untyped.append(name)
    assert untyped == []


def test_eval_and_metrics_answer_their_models(document: dict[str, Any]) -> None:
    paths = document["paths"]
    for path, model in (
        ("/runs/{run_id}/eval", "EvalSummaryPublic"),
        ("/runs/{run_id}/metrics", "MetricSeriesPublic"),
    ):
        media = paths[path]["get"]["responses"]["200"]["content"]["application/json"]
        assert media["schema"] == {"$ref": REF + model}
    schemas = document["components"]["schemas"]
    eval_set = _resolve(document, schemas["EvalSummaryPublic"]["properties"]["tasks"])
    assert eval_set["additionalProperties"] == {"$ref": REF + "EvalSetSummary"}
    assert set(schemas["EvalSetSummary"]["properties"]) == {
        "task",
        "baseline",
        "latest",
        "best",
        "history",
        "skipped_examples",
    }
    series = schemas["MetricSeriesPublic"]
    assert series["type"] == "object"
    assert series["additionalProperties"] == {"$ref": REF + "MetricSeries"}
    assert set(schemas["MetricSeries"]["properties"]) == {"steps", "values"}


def test_the_workflow_is_published_with_its_schema(document: dict[str, Any]) -> None:
    paths, schemas = document["paths"], document["components"]["schemas"]
    workflow = {"$ref": REF + "Workflow"}
    for path in ("/workflows", "/workflows/validate"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == workflow, path
    for model in ("RunCreate", "RunResume"):
        assert schemas[model]["properties"]["workflow"]["anyOf"][0] == workflow, model
    assert schemas["WorkflowPublic"]["properties"]["workflow"] == workflow
    published = schemas["Workflow"]
    assert set(published["properties"]) == set(Workflow.model_fields)
    assert set(published["required"]) == {
        "name",
        "model",
        "tokenizer",
        "microbatch_tokens",
        "phases",
    }
    assert published["additionalProperties"] is False
    # Its parts are components too: a client can build a phase.
    assert schemas["Phase"]["properties"]["objective"]


def test_the_published_workflow_schema_takes_every_example_as_written_and_normalised(
    document: dict[str, Any],
) -> None:
    """A document the service takes is one the schema takes: a client checking a workflow
    against it before sending never refuses a valid one (an eval set's `name`, which defaults
    to its task, is not required)."""
    validator = jsonschema_rs.validator_for(
        {"$ref": REF + "Workflow", "components": document["components"]}
    )
    examples = sorted((ROOT / "examples" / "workflows").glob("*.json"))
    assert examples
    for path in examples:
        written = json.loads(path.read_text())
        for form in (written, Workflow.model_validate(written).normalized()):
            problems = [(e.instance_path, e.message) for e in validator.iter_errors(form)]
            assert problems == [], path.name
    assert not validator.is_valid({**written, "phases": []})


def test_jobs_reference_their_request_and_result_models(document: dict[str, Any]) -> None:
    job = document["components"]["schemas"]["Job"]["properties"]
    assert [s["$ref"] for s in job["request"]["anyOf"]] == [
        REF + "InspectRequest",
        REF + "PrepareRequest",
        REF + "EvaluateRequest",
    ]
    assert [s.get("$ref") for s in job["result"]["anyOf"]] == [
        REF + "InspectionReport",
        REF + "PreparedStore",
        REF + "EvalResult",
        None,
    ]


def _properties(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(schema, dict):
        yield from schema.get("properties", {}).items()
        for value in schema.values():
            yield from _properties(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _properties(value)


def test_every_time_is_a_date_time(document: dict[str, Any]) -> None:
    times = [
        (name, field)
        for name, field in _properties(document["components"]["schemas"])
        if name.endswith("_at") or name == "at"
    ]
    assert len(times) > 10
    for name, field in times:
        variants = field.get("anyOf", [field])
        assert {"type": "string", "format": "date-time"} in [
            {k: v for k, v in variant.items() if k in ("type", "format")} for variant in variants
        ], name
