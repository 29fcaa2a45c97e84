"""The worker's side of confined paths and checked checkpoints: it refuses a claim's or a job's
file outside its data roots before reading it, and loads weights from safetensors only, naming
the file and what is wrong (worker.process.claim.verify_inputs, worker.process.jobs,
worker.model.model)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from contracts.paths import DataRoots
from contracts.reports import Claim
from contracts.workflow import Workflow
from worker.error import ConfigError
from worker.model.model import load_weights
from worker.process.claim import verify_inputs
from worker.process.jobs import job_outcome
from worker.settings import WorkerSettings


def model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


def weights(path: Path, **shapes: tuple[int, ...]) -> Path:
    tensors = {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}
    tensors.update({name: torch.zeros(*shape) for name, shape in shapes.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def test_safetensors_that_fit_are_loaded(tmp_path: Path) -> None:
    load_weights(model(), weights(tmp_path / "w.safetensors"))


def test_a_pickle_is_refused_unread(tmp_path: Path) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, ...]:
            return (pytest.fail, ("unpickled!",))

    path = tmp_path / "w.bin"
    path.write_bytes(pickle.dumps({"weight": Boom()}))
    with pytest.raises(ConfigError, match="never unpickles") as refused:
        load_weights(model(), path)
    assert str(path) in str(refused.value)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = weights(tmp_path / "w.safetensors")
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ConfigError, match="not a readable safetensors file") as refused:
        load_weights(model(), path)
    assert str(path) in str(refused.value)


def test_wrong_shapes_and_names_are_named_with_the_file(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.safetensors"
    save_file({"weight": torch.zeros(3, 5), "bias": torch.zeros(3)}, str(wrong))
    with pytest.raises(
        ConfigError, match=r"shapes differ: \['weight \(3, 5\) vs model \(3, 4\)'\]"
    ):
        load_weights(model(), wrong)
    extra = weights(tmp_path / "extra.safetensors", other=(2,))
    with pytest.raises(ConfigError, match=rf"weights {extra} do not fit the model: .*unexpected"):
        load_weights(model(), extra)


def test_a_shard_index_naming_a_file_outside_its_directory_is_refused(tmp_path: Path) -> None:
    weights(tmp_path / "outside.safetensors")
    directory = tmp_path / "model"
    directory.mkdir()
    index = {"weight_map": {"weight": "../outside.safetensors", "bias": "../outside.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="not a file name in its directory"):
        load_weights(model(), directory)


@pytest.fixture
def data_workflow(
    make_workflow: Callable[..., Workflow], make_text_file: Callable[..., Path]
) -> Workflow:
    return make_workflow(
        [
            {
                "name": "pt",
                "objective": "continued_pretrain",
                "data": [make_text_file()],
                "steps": 1,
            }
        ]
    )


def test_verify_inputs_refuses_a_file_outside_the_roots_before_reading_it(
    data_workflow: Workflow,
    make_claim: Callable[..., Claim],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    claim = make_claim(data_workflow)
    roots = DataRoots.of([tmp_path_factory.getbasetemp()], artifact_root=tmp_path / "artifacts")
    hashed: list[int] = []
    verify_inputs(claim, data_workflow, lambda: hashed.append(1), roots=roots)
    assert hashed, "inside the roots: hashed"

    narrow = DataRoots.of([tmp_path / "elsewhere"])
    hashed.clear()
    with pytest.raises(ConfigError, match="outside the data roots") as refused:
        verify_inputs(claim, data_workflow, lambda: hashed.append(1), roots=narrow)
    assert data_workflow.tokenizer in str(refused.value)
    assert hashed == [], "nothing was read"


def test_verify_inputs_refuses_an_initial_checkpoint_linked_out_of_the_roots(
    data_workflow: Workflow,
    make_claim: Callable[..., Claim],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    link = tmp_path / "base.safetensors"
    link.symlink_to("/etc/hostname")
    claim = make_claim(data_workflow, initial_checkpoint=str(link))
    roots = DataRoots.of([tmp_path_factory.getbasetemp()])
    with pytest.raises(ConfigError, match=r"initial checkpoint: .* resolves to /etc/hostname"):
        verify_inputs(claim, data_workflow, roots=roots)


@pytest.mark.parametrize(
    ("kind", "request_"),
    [
        (
            "inspection",
            {
                "path": "/etc/shadow",
                "tokenizer": "TOKENIZER",
                "objective": "continued_pretrain",
                "sequence_length": 8,
            },
        ),
        (
            "evaluation",
            {"checkpoint": "/etc", "task": "summarization", "data": "DATA", "sequence_length": 8},
        ),
    ],
)
def test_a_job_naming_a_file_outside_the_roots_fails_naming_it(
    tmp_path: Path, kind: str, request_: dict[str, object]
) -> None:
    (tmp_path / "data.jsonl").write_text("{}\n")
    request = {
        k: str(tmp_path / "data.jsonl") if v in ("TOKENIZER", "DATA") else v
        for k, v in request_.items()
    }
    settings = WorkerSettings(home=tmp_path / "home", data_roots=(tmp_path,))
    outcome = job_outcome(kind, request, settings=settings)  # type: ignore[arg-type]
    assert outcome.status == "failed"
    assert outcome.error is not None
    outside = request.get("path") or request["checkpoint"]
    assert f"{outside} is outside the data roots" in outcome.error, outcome.error
    assert str(tmp_path) in outcome.error
