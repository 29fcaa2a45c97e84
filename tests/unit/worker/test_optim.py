from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from contracts.workflow import OptimizerSpec
from worker.error import ConfigError
from worker.optim import build_optimizers, split_parameters


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
