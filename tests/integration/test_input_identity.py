"""A run's identity is its inputs' bytes: two runs over a data file that changed between them
are different inputs however the file was changed, through the API as a person submits them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from contracts.signature import sha256_file

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


def submit(api: Api, doc: dict[str, Any]) -> dict[str, Any]:
    response = api.client.post("/runs", json={"workflow": doc}, headers=api.admin)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_runs_over_a_file_rewritten_in_place_with_its_mtime_put_back_are_different_inputs(
    make_settings: SettingsFactory,
    make_api: ApiFactory,
    tiny_workflow: WorkflowFactory,
    tmp_path: Path,
    rewrite_in_place: Callable[[Path, bytes], None],
) -> None:
    api = make_api(make_settings())
    doc = tiny_workflow(phases=1)
    data = tmp_path / "data" / "pretrain.jsonl"
    before = sha256_file(data)
    first = submit(api, doc)
    # The same size and mtime, as `cp -p` or `rsync -a` of an edited copy leaves it.
    rewrite_in_place(data, data.read_bytes().replace(b"quick", b"QUICK"))
    second = submit(api, doc)

    answer = api.client.get(
        "/runs/compare", params={"ids": f"{first['id']},{second['id']}"}, headers=api.admin
    )
    assert answer.status_code == 200, answer.text
    inputs = answer.json()["inputs"]
    assert inputs["identical"] is False and inputs["same_signature"] is False
    assert {d["field"]: d["values"] for d in inputs["differences"]} == {
        f'data["{data}"].sha256': [before, sha256_file(data)]
    }
