"""Content digests of a run's inputs. The service only hashes files; it never reads them.
Hashing a corpus takes seconds per GiB: digests come from the one cache both sides use
(runtime/digest.py), so resubmitting a workflow over unchanged files costs stats.
"""

from __future__ import annotations

from contracts.signature import Digests
from contracts.workflow import Workflow as WorkflowSpec
from runtime.digest import digest_path
from service.errors import ApiError


def resolve_digests(workflow: WorkflowSpec, *, initial_checkpoint: str | None) -> Digests:
    """Digests of every external input; 422 `missing_input` naming each one that is gone."""
    problems: list[dict[str, str]] = []

    def digest(field: str, path: str) -> str:
        try:
            return digest_path(path)
        except (OSError, ValueError) as err:  # gone, unreadable, a NUL byte, a name too long
            problems.append({"path": field, "message": f"cannot read {path}: {err}"})
            return ""

    tokenizer = digest("tokenizer", workflow.tokenizer)
    data = {path: digest(f'data["{path}"]', path) for path in workflow.data_paths()}
    pretrained = (
        None
        if workflow.model.pretrained is None
        else digest("model.pretrained", workflow.model.pretrained)
    )
    checkpoint = (
        None if initial_checkpoint is None else digest("initial_checkpoint", initial_checkpoint)
    )
    if problems:
        raise ApiError(
            422,
            "missing_input",
            "cannot hash the run's inputs: "
            + "; ".join(f"{p['path']}: {p['message']}" for p in problems)
            + "; check that the service can read these paths (relative paths resolve against "
            "TRAINCTL_DATA_ROOT)",
            problems,
        )
    return Digests(
        tokenizer=tokenizer, data=data, initial_checkpoint=checkpoint, pretrained=pretrained
    )
