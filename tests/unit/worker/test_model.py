from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from contracts.workflow import Workflow
from worker.data.tokenizer import load_tokenizer
from worker.error import ConfigError
from worker.model.model import build_model, load_weights, select_device


def workflow_with(
    make_workflow: Callable[..., Workflow], tmp_path: Path, **kwargs: object
) -> Workflow:
    data = tmp_path / "t.txt"
    data.write_text("the cat\n")
    phase = {"name": "p", "objective": "continued_pretrain", "data": [data], "steps": 1}
    return make_workflow([phase], **kwargs)


def test_initialisation_is_a_function_of_the_seed(
    make_workflow: Callable[..., Workflow], tmp_path: Path
) -> None:
    cpu = torch.device("cpu")
    a = build_model(workflow_with(make_workflow, tmp_path, seed=1), cpu).state_dict()
    torch.manual_seed(999)  # whatever the process drew before
    b = build_model(workflow_with(make_workflow, tmp_path, seed=1), cpu).state_dict()
    c = build_model(workflow_with(make_workflow, tmp_path, seed=2), cpu).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_a_bad_model_config_is_a_config_error(
    make_workflow: Callable[..., Workflow], tmp_path: Path
) -> None:
    workflow = workflow_with(make_workflow, tmp_path, model={"initializer_range": 1e37})
    with pytest.raises(
        ConfigError, match=r"model\.config \(model_type 'llama'\): .*initializer_range"
    ):
        build_model(workflow, torch.device("cpu"))


def test_weights_of_another_shape_are_refused(
    make_workflow: Callable[..., Workflow], tmp_path: Path
) -> None:
    small = build_model(workflow_with(make_workflow, tmp_path), torch.device("cpu"))
    small.save_pretrained(tmp_path / "small")
    wide = build_model(
        workflow_with(make_workflow, tmp_path, model={"hidden_size": 64}), torch.device("cpu")
    )
    with pytest.raises(ConfigError, match="shapes differ"):
        load_weights(wide, tmp_path / "small")


def test_tokenizer_loads_from_a_file_or_its_directory(tokenizer_path: Path) -> None:
    assert (
        load_tokenizer(tokenizer_path).get_vocab()
        == load_tokenizer(tokenizer_path.parent).get_vocab()
    )


def test_a_tokenizer_without_the_special_tokens_is_refused(tmp_path: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(
        ["the cat sat"], trainers.BpeTrainer(special_tokens=["<|endoftext|>"])
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"lacks the special token\(s\) <\|pad\|>"):
        load_tokenizer(tmp_path)


def test_cpu_is_chosen_when_asked_or_when_cuda_is_absent() -> None:
    assert select_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert select_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="CUDA is not available"):
            select_device("cuda")
