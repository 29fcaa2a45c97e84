from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response, status
from sqlalchemy.orm import Session

from contracts.api import WorkflowPublic, WorkflowValidation
from contracts.documented import DocumentedAs
from contracts.workflow import Workflow as WorkflowSpec
from contracts.workflow import plan
from service import access
from service.api.deps import ApiTokenDep, SessionDep, SettingsDep, require_api
from service.models import ApiToken
from service.runs.workflow import (
    add_workflow_owner,
    get_workflow,
    parse_workflow,
    save_workflow,
    workflow_public,
)
from service.settings import ServiceSettings

router = APIRouter(prefix="/workflows", tags=["workflows"], dependencies=[Depends(require_api)])

# Received raw (any JSON) so that parse_workflow reports every problem at once with its JSON
# path; published as the Workflow's schema (contracts.documented.DocumentedAs).
WorkflowDocument = Annotated[
    Any, DocumentedAs(WorkflowSpec), Body(description="a workflow document (JSON object)")
]


def _parse(doc: Any, session: Session, settings: ServiceSettings, token: ApiToken) -> WorkflowSpec:
    """The document parsed as `token` may submit it: paths against the data root, inside the
    data roots, and in the folders only of runs it may see (parse_workflow)."""
    return parse_workflow(
        doc,
        data_root=settings.data_root,
        roots=settings.paths,
        session=session,
        owner_id=access.owner_filter(token),
    )


@router.post("/validate")
def validate(
    doc: WorkflowDocument, session: SessionDep, settings: SettingsDep, token: ApiTokenDep
) -> WorkflowValidation:
    """The plan of a valid workflow, or 422 `invalid_workflow` listing every problem (422
    `path_outside_data_roots` when a file lies outside TRAINCTL_DATA_ROOTS; 404
    `run_not_found` for a pretrained model in the folder of a run the token may not see)."""
    spec = _parse(doc, session, settings, token)
    return WorkflowValidation(valid=True, plan=plan(spec))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={
        200: {
            "model": WorkflowPublic,
            "description": "This token stored or ran the same workflow before",
        }
    },
)
def create_workflow(
    doc: WorkflowDocument,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    token: ApiTokenDep,
) -> WorkflowPublic:
    """Store a workflow under the SHA-256 of its normalised form, owned by the caller among
    others (service.runs.workflow): 201 when it is new to this token, 200 when this token stored
    or ran the same workflow (same id) before. Whether another token did is not told."""
    spec = _parse(doc, session, settings, token)
    workflow, _ = save_workflow(session=session, spec=spec)
    created = add_workflow_owner(session=session, workflow_id=workflow.id, owner_id=token.id)
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    return workflow_public(workflow)


@router.get("/{workflow_id}")
def read_workflow(workflow_id: str, session: SessionDep, token: ApiTokenDep) -> WorkflowPublic:
    """The workflow; to a user token, only one it stored or ran (404 otherwise, as for an id
    that does not exist)."""
    workflow = get_workflow(
        session=session, workflow_id=workflow_id, owner_id=access.owner_filter(token)
    )
    return workflow_public(workflow)
