from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response, status

from contracts.workflow import plan
from service.deps import SessionDep, SettingsDep, require_api
from service.schemas import WorkflowPublic, WorkflowValidation
from service.workflow import get_workflow, parse_workflow, save_workflow, workflow_public

router = APIRouter(prefix="/workflows", tags=["workflows"], dependencies=[Depends(require_api)])

WorkflowDocument = Annotated[Any, Body(description="a workflow document (JSON object)")]


@router.post("/validate")
def validate(doc: WorkflowDocument, settings: SettingsDep) -> WorkflowValidation:
    """The plan of a valid workflow, or 422 `invalid_workflow` listing every problem (422
    `path_outside_data_roots` when a file lies outside TRAINCTL_DATA_ROOTS)."""
    spec = parse_workflow(doc, data_root=settings.data_root, roots=settings.paths)
    return WorkflowValidation(valid=True, plan=plan(spec))


@router.post("", status_code=status.HTTP_201_CREATED)
def create_workflow(
    doc: WorkflowDocument, session: SessionDep, settings: SettingsDep, response: Response
) -> WorkflowPublic:
    """Store a workflow under the SHA-256 of its normalised form: 201 when new, 200 when the
    same workflow was stored before (same id)."""
    spec = parse_workflow(doc, data_root=settings.data_root, roots=settings.paths)
    workflow, created = save_workflow(session=session, spec=spec)
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    return workflow_public(workflow)


@router.get("/{workflow_id}")
def read_workflow(workflow_id: str, session: SessionDep) -> WorkflowPublic:
    return workflow_public(get_workflow(session=session, workflow_id=workflow_id))
