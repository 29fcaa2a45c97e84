"""Private random streams: what a phase draws (weight initialisation, dropout) comes from
generators of its own, never from torch's process-wide one.

The original PR's flaky test: dropout masks came from the backend's global generator, which
every other user of the process drew from too, so one model's masks depended on what ran beside
it. torch's global generator is shared by every thread, and dropout takes no generator, so
seeding it is not enough. `PrivateRandom.drawing()` enters a torch function mode (thread-local:
other threads are untouched) that hands the private generator of the tensor's device to every
random draw that accepts one, replaces dropout and attention dropout with versions that draw
from it, and refuses the few random functions it cannot redirect rather than let them draw from
the shared stream unseen.

Data order draws from numpy generators of its own (`worker.data.batch`); nothing of a phase draws
from Python's or numpy's global streams either.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from worker.error import ConfigError

# Built-in random functions that accept `generator=`: given the private one when called
# without one. Python-level functions (torch.nn.init, and the wrappers transformers puts in
# their place while it initialises a model) are recognised by their signature instead.
_BUILTINS_TAKING_A_GENERATOR: frozenset[Callable[..., Any]] = frozenset(
    [
        *(
            getattr(torch.Tensor, name)
            for name in (
                "normal_",
                "uniform_",
                "bernoulli_",
                "random_",
                "exponential_",
                "log_normal_",
                "cauchy_",
                "geometric_",
            )
        ),
        *(
            getattr(torch, name)
            for name in (
                "rand",
                "randn",
                "randint",
                "randperm",
                "rand_like",
                "randn_like",
                "randint_like",
                "normal",
                "bernoulli",
                "multinomial",
            )
        ),
    ]
)


@functools.cache
def _takes_a_generator(func: Callable[..., Any]) -> bool:
    if func in _BUILTINS_TAKING_A_GENERATOR:
        return True
    try:
        return "generator" in inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


# Random functions that draw from the global generator and take none: refused, naming them.
_GLOBAL_ONLY: frozenset[Callable[..., Any]] = frozenset(
    [
        F.alpha_dropout,
        F.feature_alpha_dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.rrelu,
        F.gumbel_softmax,
    ]
)


class PrivateRandom:
    """The random streams of one model: a CPU generator, and one for the accelerator the
    model trains on. `state_dict` and `load_state_dict` carry them through a checkpoint."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self._generators = {"cpu": torch.Generator().manual_seed(seed)}
        if device.type != "cpu":
            accelerator = torch.Generator(device=device).manual_seed(seed)
            self._generators[device.type] = accelerator

    def generator(self, device: torch.device | str | None) -> torch.Generator:
        kind = torch.device(device).type if device is not None else "cpu"
        found = self._generators.get(kind)
        if found is None:
            raise RuntimeError(f"no private generator for device {kind!r}")
        return found

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {kind: g.get_state() for kind, g in self._generators.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Continue from `state`; returns the devices it held no state for (their generators
        keep their seed). State for a device this one lacks is ignored."""
        missing = []
        for kind, generator in self._generators.items():
            value = state.get(kind)
            if isinstance(value, torch.Tensor):
                generator.set_state(value)
            else:
                missing.append(kind)
        return missing

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Within the block, on this thread, random draws come from these generators."""
        with _PrivateDraws(self):
            yield


class _PrivateDraws(TorchFunctionMode):
    def __init__(self, rng: PrivateRandom) -> None:
        super().__init__()
        self._rng = rng

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _takes_a_generator(func):
            if kwargs.get("generator") is None:
                kwargs["generator"] = self._rng.generator(_device_of(args, kwargs))
        elif func is F.dropout:
            return _dropout(self._rng, *args, **kwargs)
        elif func is F.scaled_dot_product_attention:
            if kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) > 0.0:
                return _attention_with_dropout(self._rng, *args, **kwargs)
        elif func in _GLOBAL_ONLY:
            raise ConfigError(
                f"{func.__name__} draws from torch's global random generator, which trainctl "
                "keeps out of training (a run must not depend on what else the process "
                "draws); use a model without it"
            )
        return func(*args, **kwargs)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | str | None:
    """The device a random function draws on: its first tensor argument's, else its
    `device=`."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")
    return device if isinstance(device, torch.device | str) else None


def _dropout(
    rng: PrivateRandom,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """`F.dropout`, its mask drawn from the private generator."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input.zero_() if inplace else torch.zeros_like(input)
    keep = torch.empty_like(input).bernoulli_(1.0 - p, generator=rng.generator(input.device))
    scale = keep.div_(1.0 - p)
    return input.mul_(scale) if inplace else input * scale


def _attention_with_dropout(
    rng: PrivateRandom,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with dropout on the attention weights, as its
    documented reference computes it, the dropout mask drawn from the private generator."""
    length, source = query.size(-2), key.size(-2)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa:
        repeats = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeats, dim=-3)
        value = value.repeat_interleave(repeats, dim=-3)
    bias = torch.zeros(length, source, dtype=query.dtype, device=query.device)
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        bias.masked_fill_(allowed.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = bias + attn_mask
    weights = torch.softmax(query @ key.transpose(-2, -1) * factor + bias, dim=-1)
    weights = _dropout(rng, weights, dropout_p)
    return weights @ value
