from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from contracts.workflow import OptimizerSpec
from worker.error import ConfigError, OptimizerCoverageError
from worker.model.optim import build_optimizers, split_parameters


def tiny_model(**overrides: Any) -> PreTrainedModel:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        **{
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 32,
            **overrides,
        },
    )
    return AutoModelForCausalLM.from_config(config)


def train_one_step(model: PreTrainedModel, optimizers: Any) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizers.step()
    optimizers.zero_grad()


@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_is_in_exactly_one_group(tied: bool) -> None:
    model = tiny_model(tie_word_embeddings=tied)
    muon, adamw = split_parameters(model)
    names = [name for name, _ in model.named_parameters()]
    assert sorted(muon + adamw) == sorted(names)
    assert not set(muon) & set(adamw)
    assert ("lm_head.weight" in adamw) is not tied  # a tied head is the embedding, listed once


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw() -> None:
    model = tiny_model()
    muon, adamw = split_parameters(model)
    params = dict(model.named_parameters())
    assert "model.embed_tokens.weight" in adamw
    assert "lm_head.weight" in adamw
    assert "model.layers.0.self_attn.q_proj.weight" in muon
    assert "model.layers.1.mlp.down_proj.weight" in muon
    assert all(params[n].ndim == 2 and ".layers." in n for n in muon)
    assert all(params[n].ndim == 1 for n in adamw if "embed" not in n and "lm_head" not in n)


def test_optimizer_state_roundtrips_by_name_into_a_new_model() -> None:
    spec = OptimizerSpec()
    model = tiny_model()
    optimizers = build_optimizers(model, spec)
    train_one_step(model, optimizers)
    buffer = io.BytesIO()
    torch.save(optimizers.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert set(saved["muon"]["state"]) == set(optimizers.muon_names)

    other = tiny_model()
    other.load_state_dict(model.state_dict())
    restored = build_optimizers(other, spec)
    restored.load_state_dict(saved)
    params = dict(other.named_parameters())
    for name, state in saved["adamw"]["state"].items():
        live = restored.adamw.state[params[name]]
        assert torch.equal(live["exp_avg"], state["exp_avg"])
    for name, state in saved["muon"]["state"].items():
        live = restored.muon.state[params[name]]
        assert torch.equal(live["momentum_buffer"], state["momentum_buffer"])


def test_state_for_other_parameter_names_is_refused_with_the_names() -> None:
    model = tiny_model()
    optimizers = build_optimizers(model, OptimizerSpec())
    train_one_step(model, optimizers)
    saved = optimizers.state_dict()
    deeper = tiny_model(num_hidden_layers=3)
    with pytest.raises(
        ConfigError, match=r"7 model parameters have no saved state \['model\.layers\.2\."
    ):
        build_optimizers(deeper, OptimizerSpec()).load_state_dict(saved)


def test_learning_rates_are_set_per_optimizer() -> None:
    optimizers = build_optimizers(tiny_model(), OptimizerSpec())
    optimizers.set_lr(muon_lr=0.5, adamw_lr=0.25)
    assert [g["lr"] for g in optimizers.muon.param_groups] == [0.5]
    assert [g["lr"] for g in optimizers.adamw.param_groups] == [0.25]


def _resume(*, optimizers_first: bool) -> tuple[PreTrainedModel, Any]:
    """A resume whose weights load by replacing the Parameter objects (`assign=True`), with the
    optimizers built before (the real bug) or after (the correct order) the load."""
    saved = tiny_model()
    train_one_step(saved, build_optimizers(saved, OptimizerSpec()))
    state = {name: tensor.clone() for name, tensor in saved.state_dict().items()}
    model = tiny_model()
    if optimizers_first:
        optimizers = build_optimizers(model, OptimizerSpec())
        model.load_state_dict(state, assign=True)
    else:
        model.load_state_dict(state, assign=True)
        optimizers = build_optimizers(model, OptimizerSpec())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    return model, optimizers


def test_coverage_check_catches_optimizers_built_before_the_weights_were_loaded() -> None:
    model, optimizers = _resume(optimizers_first=True)
    live = {name: param.detach().clone() for name, param in model.named_parameters()}
    with pytest.raises(OptimizerCoverageError, match="without a gradient") as caught:
        optimizers.step_checking_coverage()
    message = str(caught.value)
    assert "model.layers.0.self_attn.q_proj.weight" in message
    assert f"left {len(live)} optimizer parameters without a gradient" in message
    assert caught.value.cause == "config"
    # Indeed nothing the model uses was trained.
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), live[name]), name


def test_coverage_check_passes_when_optimizers_are_built_after_the_weights() -> None:
    model, optimizers = _resume(optimizers_first=False)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizers.step_checking_coverage()
    for name, param in model.named_parameters():
        assert not torch.equal(param.detach(), before[name]), name


def test_coverage_check_names_a_parameter_that_got_no_gradient() -> None:
    model = tiny_model()
    optimizers = build_optimizers(model, OptimizerSpec())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    model.model.layers[1].mlp.up_proj.weight.grad = None
    with pytest.raises(OptimizerCoverageError, match=r"1 optimizer parameters without .*up_proj"):
        optimizers.step_checking_coverage()
