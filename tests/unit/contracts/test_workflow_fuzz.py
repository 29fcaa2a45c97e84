"""Hostile workflow documents (hypothesis, tests/unit/contracts/workflow_mutations.py) meet
only the errors they should: the model raises pydantic's ValidationError, `validate_workflow`
raises WorkflowInvalid naming each problem by a JSON path, and never anything else. A document
that passes plans and normalises without an error too. The live API's side of the same is in
tests/integration/test_fuzz_api.py."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError
from workflow_mutations import hostile_workflows

from contracts.workflow import Workflow, WorkflowInvalid, plan, validate_workflow

BASE: dict[str, Any] = {
    "name": "fuzz",
    "model": {"config": {"vocab_size": 256, "max_position_embeddings": 128}},
    "tokenizer": "tokenizer.json",
    "microbatch_tokens": 128,
    "checkpoint": {"every_steps": 5, "keep_last": 2},
    "optimizer": {"muon_lr": 0.02, "adamw_betas": [0.9, 0.95], "grad_clip": 1.0},
    "evals": [{"task": "summarization", "data": "summaries.jsonl", "every_steps": 5}],
    "phases": [
        {
            "name": "pretrain",
            "objective": "continued_pretrain",
            "data": [{"path": "pretrain.jsonl", "weight": 1.0}],
            "sequence_length": 64,
            "microbatch_size": 2,
            "steps": 10,
            "schedule": {"kind": "wsd", "warmup_steps": 2},
            "inspection": {"max_trimmed_share": 0.5},
        },
        {
            "name": "summarize",
            "objective": "summarization",
            "data": [{"path": "summaries.jsonl", "name": "sum"}],
            "sequence_length": 64,
            "microbatch_size": 2,
            "steps": 10,
            "optimizer_state": "carry",
        },
    ],
}
# Deterministic: the same documents on every run and machine (derandomize), no example database.
FUZZ = settings(
    max_examples=400,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_the_base_document_is_valid() -> None:
    validate_workflow(BASE)


@FUZZ
@given(doc=hostile_workflows(BASE))
def test_the_model_raises_only_validation_errors(doc: Any) -> None:
    with contextlib.suppress(ValidationError):
        Workflow.model_validate(doc)


@FUZZ
@given(doc=hostile_workflows(BASE))
def test_every_problem_is_named_by_a_json_path(doc: Any) -> None:
    try:
        workflow = validate_workflow(doc)
    except WorkflowInvalid as err:
        assert err.problems, "an invalid workflow names at least one problem"
        for problem in err.problems:
            assert problem.path and isinstance(problem.path, str), problem
            assert problem.message, problem
        return
    plan(workflow)
    json.dumps(workflow.normalized(), allow_nan=False)
