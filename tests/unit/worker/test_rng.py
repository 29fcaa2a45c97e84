"""The private random streams of `worker.model.rng`: what they redirect, what they refuse, and that
torch's global generator is neither read nor advanced inside them."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from worker.error import ConfigError
from worker.model.rng import PrivateRandom

CPU = torch.device("cpu")


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_draws_inside_come_from_the_private_generator_and_leave_the_global_one_alone() -> None:
    before = torch.get_rng_state()
    with PrivateRandom(7, CPU).drawing():
        drawn = torch.rand(4)
        tensor = torch.empty(3).normal_()
        initialised = torch.nn.init.kaiming_uniform_(torch.empty(2, 3))
    assert torch.equal(torch.get_rng_state(), before)

    expected = fresh(7)
    assert torch.equal(drawn, torch.rand(4, generator=expected))
    assert torch.equal(tensor, torch.empty(3).normal_(generator=expected))
    assert torch.equal(
        initialised, torch.nn.init.kaiming_uniform_(torch.empty(2, 3), generator=expected)
    )


def test_an_explicit_generator_is_kept() -> None:
    mine = fresh(3)
    with PrivateRandom(7, CPU).drawing():
        drawn = torch.rand(2, generator=mine)
    assert torch.equal(drawn, torch.rand(2, generator=fresh(3)))


def test_the_mode_is_private_to_its_thread() -> None:
    torch.manual_seed(5)
    outside: list[torch.Tensor] = []
    with PrivateRandom(7, CPU).drawing():
        thread = threading.Thread(target=lambda: outside.append(torch.rand(2)))
        thread.start()
        thread.join()
    torch.manual_seed(5)
    assert torch.equal(outside[0], torch.rand(2)), "the other thread drew from the global stream"


def test_dropout_masks_repeat_with_the_seed_and_scale_what_they_keep() -> None:
    x = torch.ones(64, 64)
    with PrivateRandom(1, CPU).drawing():
        a = F.dropout(x, p=0.25, training=True)
    with PrivateRandom(1, CPU).drawing():
        b = torch.nn.Dropout(0.25)(x)
        unchanged = F.dropout(x, p=0.25, training=False)
        inplace = F.dropout(x.clone(), p=0.25, inplace=True)
    assert torch.equal(a, b)
    assert not torch.equal(a, inplace)  # the stream moved on
    assert torch.equal(a.unique(), torch.tensor([0.0, 1 / 0.75]))
    assert 0.15 < (a == 0).float().mean().item() < 0.35
    assert unchanged is x
    with PrivateRandom(1, CPU).drawing():
        assert torch.equal(F.dropout(x, p=1.0), torch.zeros_like(x))
        with pytest.raises(ValueError, match="between 0 and 1"):
            F.dropout(x, p=1.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"is_causal": True},
        {"is_causal": True, "enable_gqa": True},
        {"attn_mask": "bool"},
        {"attn_mask": "float", "scale": 0.3},
    ],
)
def test_attention_with_dropout_is_the_documented_attention(kwargs: dict[str, object]) -> None:
    g = fresh(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    heads = 2 if kwargs.get("enable_gqa") else 4
    k, v = torch.randn(2, heads, 6, 8, generator=g), torch.randn(2, heads, 6, 8, generator=g)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(6, 6, generator=g) > 0.3
        kwargs["attn_mask"][:, 0] = True  # every query sees a key
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 6, 6, generator=g)
    reference = F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]
    with PrivateRandom(0, CPU).drawing():
        # A dropout so small that no weight is dropped: the rest of the computation shows.
        nearly = F.scaled_dot_product_attention(q, k, v, dropout_p=1e-12, **kwargs)  # type: ignore[arg-type]
    torch.testing.assert_close(nearly, reference)


def test_attention_dropout_draws_privately() -> None:
    q = torch.randn(1, 2, 5, 4, generator=fresh(0))
    before = torch.get_rng_state()
    outputs = []
    for _ in range(2):
        with PrivateRandom(9, CPU).drawing():
            outputs.append(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_random_functions_that_take_no_generator_are_refused_by_name() -> None:
    with PrivateRandom(0, CPU).drawing(), pytest.raises(ConfigError, match="alpha_dropout"):
        F.alpha_dropout(torch.ones(4), p=0.5, training=True)


def test_state_continues_the_stream_and_names_what_it_lacks() -> None:
    rng = PrivateRandom(4, CPU)
    torch.rand(3, generator=rng.generator(CPU))
    state = rng.state_dict()
    expected = torch.rand(3, generator=rng.generator("cpu"))

    resumed = PrivateRandom(0, CPU)
    assert resumed.load_state_dict(state) == []
    assert torch.equal(torch.rand(3, generator=resumed.generator(None)), expected)

    # A checkpoint of an older trainctl held the global streams instead.
    assert PrivateRandom(0, CPU).load_state_dict({"torch": torch.get_rng_state()}) == ["cpu"]
    with pytest.raises(RuntimeError, match="no private generator for device 'meta'"):
        rng.generator("meta")
