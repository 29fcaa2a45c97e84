"""Muon for the 2-D weights inside the transformer blocks, AdamW for everything else.

Groups are derived BY NAME from the live model, after its weights are loaded, and a checkpoint
stores optimizer state keyed by parameter name: a resumed optimizer recognises its parameters by
what they are called, never by the identity or order of tensors in an earlier process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from contracts.workflow import OptimizerSpec
from worker.error import ConfigError, OptimizerCoverageError

MUON = "muon"
ADAMW = "adamw"
_EXCLUDED_FROM_MUON = ("embed", "lm_head")


def split_parameters(model: nn.Module) -> tuple[list[str], list[str]]:
    """(muon names, adamw names), together every trainable parameter exactly once.
    `named_parameters` lists a tied weight (embedding = head) once, under its first name."""
    embeddings = {
        f"{module_name}.weight" if module_name else "weight"
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
    }
    muon: list[str] = []
    adamw: list[str] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        hidden_matrix = (
            param.ndim == 2
            and name not in embeddings
            and not any(part in name for part in _EXCLUDED_FROM_MUON)
        )
        (muon if hidden_matrix else adamw).append(name)
    return muon, adamw


@dataclass
class Optimizers:
    muon: torch.optim.Muon
    adamw: torch.optim.AdamW
    muon_names: list[str]
    adamw_names: list[str]

    def _pairs(self) -> Iterator[tuple[str, torch.optim.Optimizer, list[str]]]:
        yield MUON, self.muon, self.muon_names
        yield ADAMW, self.adamw, self.adamw_names

    def set_lr(self, *, muon_lr: float, adamw_lr: float) -> None:
        for group in self.muon.param_groups:
            group["lr"] = muon_lr
        for group in self.adamw.param_groups:
            group["lr"] = adamw_lr

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def step_checking_coverage(self) -> None:
        """`step`, proving that every parameter of every group got a gradient and changed.
        Copies every parameter once: meant for the first step after a resume, where an
        optimizer built over stale tensors (not the live model's) would silently train
        nothing. A group whose learning rate is 0 (a schedule's floor) is exempt from
        "changed"."""
        held = [
            (name, param, group["lr"] > 0)
            for _, optimizer, names in self._pairs()
            for group in optimizer.param_groups
            for name, param in zip(names, group["params"], strict=True)
        ]
        no_grad = [name for name, param, _ in held if param.grad is None]
        before = [param.detach().clone() for _, param, _ in held]
        self.step()
        unchanged = [
            name
            for (name, param, moves), old in zip(held, before, strict=True)
            if moves and torch.equal(param.detach(), old)
        ]
        if no_grad or unchanged:
            raise OptimizerCoverageError(
                f"the first step after resuming left {len(no_grad)} optimizer parameters "
                f"without a gradient {_some(no_grad)} and {len(unchanged)} unchanged "
                f"{_some(unchanged)}; the optimizers hold tensors the model does not use "
                "(built before the weights were loaded, or the weights were loaded by "
                "replacing the parameters): build them from the live model after loading"
            )

    def zero_grad(self) -> None:
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)

    def group_names(self) -> dict[str, list[str]]:
        return {MUON: list(self.muon_names), ADAMW: list(self.adamw_names)}

    def state_dict(self) -> dict[str, Any]:
        """{optimizer: {"names": [...], "hyper": {...}, "state": {param name: {...}}}}; tensors
        and plain values only, loadable with `torch.load(weights_only=True)`."""
        out: dict[str, Any] = {}
        for key, optimizer, names in self._pairs():
            saved = optimizer.state_dict()
            (group,) = saved["param_groups"]
            index_to_name = dict(zip(group["params"], names, strict=True))
            out[key] = {
                "names": list(names),
                "hyper": {k: v for k, v in group.items() if k not in ("params", "param_names")},
                "state": {index_to_name[i]: s for i, s in saved["state"].items()},
            }
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore state saved by `state_dict`, matching parameters by name. Refuses when the
        checkpoint's groups differ from those derived from the live model."""
        for key, optimizer, names in self._pairs():
            if key not in saved:
                raise ConfigError(f"optimizer state has no {key!r} part")
            saved_names = list(saved[key]["names"])
            if saved_names != names:
                missing = sorted(set(names) - set(saved_names))
                extra = sorted(set(saved_names) - set(names))
                raise ConfigError(
                    f"the checkpoint's {key} parameter group does not match the model: "
                    f"{len(missing)} model parameters have no saved state {_some(missing)}, "
                    f"{len(extra)} saved parameters are not in the model {_some(extra)}"
                    + ("" if missing or extra else ", and their order differs")
                    + "; the checkpoint was written for another model or another split"
                )
            (group,) = optimizer.state_dict()["param_groups"]
            name_to_index = dict(zip(names, group["params"], strict=True))
            optimizer.load_state_dict(
                {
                    "state": {name_to_index[n]: s for n, s in saved[key]["state"].items()},
                    "param_groups": [
                        {**saved[key]["hyper"], "params": group["params"], "param_names": names}
                    ],
                }
            )


def _some(names: list[str]) -> str:
    return f"{names[:5]}" + (" ..." if len(names) > 5 else "")


def build_optimizers(model: nn.Module, spec: OptimizerSpec) -> Optimizers:
    """Fresh optimizers over the live model's parameters; learning rates are set every step
    by the trainer (`Optimizers.set_lr`)."""
    muon_names, adamw_names = split_parameters(model)
    params = dict(model.named_parameters())
    muon = torch.optim.Muon(
        [(n, params[n]) for n in muon_names],
        lr=spec.muon_lr,
        momentum=spec.muon_momentum,
        weight_decay=spec.muon_weight_decay,
    )
    adamw = torch.optim.AdamW(
        [(n, params[n]) for n in adamw_names],
        lr=spec.adamw_lr,
        betas=spec.adamw_betas,
        weight_decay=spec.adamw_weight_decay,
    )
    return Optimizers(muon=muon, adamw=adamw, muon_names=muon_names, adamw_names=adamw_names)
