"""Workflows: parse with paths resolved, store content-addressed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from contracts.api import WorkflowPublic
from contracts.paths import DataRoots, PathUse
from contracts.signature import canonical_json
from contracts.workflow import Workflow as WorkflowSpec
from contracts.workflow import WorkflowInvalid, json_path, path_fields, plan
from runtime.path import resolve_paths, validate_workflow_with_files
from service.access import outside_roots
from service.checkpoints.source import check_run_folders, stored_checkpoint
from service.db import insert_for
from service.errors import ApiError, not_found
from service.models import Workflow, WorkflowOwner, utcnow


def workflow_path_fields(doc: dict[str, Any]) -> list[tuple[str, str, PathUse]]:
    """The files a (resolved) workflow document names, as (JSON path, path, use): the model's
    pretrained directory is a checkpoint, the rest data."""
    return [
        (json_path(loc), value, "checkpoint" if loc == ("model", "pretrained") else "data")
        for loc, value, _ in path_fields(doc)
    ]


def parse_workflow(
    doc: Any,
    *,
    data_root: Path,
    roots: DataRoots | None = None,
    session: Session | None = None,
    owner_id: str | None = None,
) -> WorkflowSpec:
    """Validate a submitted document, relative paths resolved against `data_root`, and check
    the files it names. 422 `path_outside_data_roots` when a file resolves outside `roots`
    (default: `data_root` alone), before anything about the files is looked at; with
    `session`, a file in a run's folder of the artifact store only of a run `owner_id` may see
    (404 `run_not_found`, service.checkpoints.source.check_run_folders), and a pretrained directory
    there then as `stored_pretrained`; 422 `invalid_workflow` lists every other problem as
    `{path, message}`."""
    if isinstance(doc, dict):
        doc = resolve_paths(doc, data_root)
        roots = roots or DataRoots.of([data_root])
        fields = workflow_path_fields(doc)
        refused = outside_roots(fields, roots, where="workflow")
        if refused is not None:
            raise refused
        if session is not None:
            check_run_folders(session=session, fields=fields, roots=roots, owner_id=owner_id)
            doc = stored_pretrained(doc, session=session, roots=roots, owner_id=owner_id)
    try:
        return validate_workflow_with_files(doc)
    except WorkflowInvalid as err:
        count = len(err.problems)
        raise ApiError(
            422,
            "invalid_workflow",
            f"the workflow has {count} problem{'s' if count != 1 else ''}: {err}",
            [p.model_dump() for p in err.problems],
        ) from None


def stored_pretrained(
    doc: dict[str, Any], *, session: Session, roots: DataRoots, owner_id: str | None
) -> dict[str, Any]:
    """A (resolved) document whose `model.pretrained` lies in a run's folder of the artifact
    store, naming that run's registered checkpoint by its registered path (the path that pins
    it, service.checkpoints.registry.pins), its row locked until the caller commits; 404
    `run_not_found` for a run `owner_id` (the caller's scope) may not see, 422
    `invalid_workflow` for no usable checkpoint there
    (service.checkpoints.source.stored_checkpoint). Any other document as it is."""
    model = doc.get("model")
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    if not isinstance(pretrained, str):
        return doc
    stored = stored_checkpoint(
        session=session,
        path=pretrained,
        roots=roots,
        owner_id=owner_id,
        field="model.pretrained",
        code="invalid_workflow",
    )
    if stored is None:
        return doc
    assert isinstance(model, dict)
    return {**doc, "model": {**model, "pretrained": stored.path}}


def workflow_id_of(spec: WorkflowSpec) -> str:
    """SHA-256 of the canonical normalised document: equal content, equal id."""
    return hashlib.sha256(canonical_json(spec.normalized()).encode()).hexdigest()


def save_workflow(*, session: Session, spec: WorkflowSpec) -> tuple[Workflow, bool]:
    """Insert the workflow unless its id exists (safe under concurrent submissions); returns the
    row and whether this call created it. Does not commit."""
    workflow_id = workflow_id_of(spec)
    stmt = (
        insert_for(session, Workflow)
        .values(id=workflow_id, name=spec.name, spec=spec.normalized(), created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(Workflow.id)
    )
    # RETURNING, not rowcount: an ORM-level INSERT does not report a reliable rowcount.
    created = session.execute(stmt).first() is not None
    row = session.get(Workflow, workflow_id)
    assert row is not None
    return row, created


def add_workflow_owner(*, session: Session, workflow_id: str, owner_id: str) -> bool:
    """Record that the token `owner_id` stored or ran the workflow; whether it is new to that
    token. One statement (INSERT ... ON CONFLICT), safe under concurrent requests. Does not
    commit."""
    stmt = (
        insert_for(session, WorkflowOwner)
        .values(workflow_id=workflow_id, owner_id=owner_id)
        .on_conflict_do_nothing(index_elements=["workflow_id", "owner_id"])
        .returning(WorkflowOwner.workflow_id)
    )
    return session.execute(stmt).first() is not None


def get_workflow(*, session: Session, workflow_id: str, owner_id: str | None = None) -> Workflow:
    """The workflow; 404 `workflow_not_found` when it does not exist or, with `owner_id` (the
    caller's scope, service.access.owner_filter), that owner neither stored nor ran it (the
    same answer)."""
    row = session.get(Workflow, workflow_id)
    if row is None or (
        owner_id is not None and session.get(WorkflowOwner, (workflow_id, owner_id)) is None
    ):
        raise not_found("workflow", workflow_id, "submit it with POST /workflows")
    return row


def stored_spec(workflow: Workflow) -> WorkflowSpec:
    """The stored, already-normalised document (its files may live elsewhere: not checked)."""
    return WorkflowSpec.model_validate(workflow.spec)


def workflow_public(workflow: Workflow) -> WorkflowPublic:
    return WorkflowPublic(
        id=workflow.id,
        name=workflow.name,
        workflow=workflow.spec,
        plan=plan(stored_spec(workflow)),
        created_at=workflow.created_at,
    )
