"""The one loss of training and evaluation: summed negative log-likelihood of target tokens.

An eval number is therefore by definition the training loss without gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from worker.data.batch import IGNORE_INDEX, Batch


def objective_loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """(sum of target-token NLL as a float32 scalar, number of target tokens). On CUDA the
    forward runs under bf16 autocast; the loss itself is always computed in float32."""
    device = batch.input_ids.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        ).logits
    nll = F.cross_entropy(
        logits.float().flatten(0, 1),
        batch.labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return nll, batch.target_tokens


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    assert isinstance(model, DistributedDataParallel)
    return model.no_sync()


@dataclass(frozen=True)
class StepLoss:
    loss: torch.Tensor  # the step's loss (detached): its NLL over its target tokens
    # Per source index present in the step: (summed NLL, target tokens), for per-source metrics.
    by_source: dict[int, tuple[torch.Tensor, int]]


def backward_step(
    model: nn.Module,
    microbatches: Sequence[Batch],
    *,
    step_tokens: int | None = None,
    grad_scale: float = 1.0,
) -> StepLoss:
    """Accumulate the gradients of one optimizer step and return its loss: the NLL of every
    microbatch over the target tokens of the whole step, so a microbatch weighs by its target
    tokens (not a mean of microbatch means).

    On many ranks (`model` a DistributedDataParallel, or sharded by FSDP2) these are this
    rank's microbatches of the step: `step_tokens` counts the target tokens of all ranks' and
    `grad_scale` (the rank count) makes the mean over ranks that DDP's all-reduce and FSDP2's
    reduce-scatter take the sum. Either communicates once, at the last microbatch."""
    total = step_tokens if step_tokens is not None else sum(b.target_tokens for b in microbatches)
    if total == 0:
        raise ValueError("a training step without target tokens")
    loss = torch.zeros((), device=microbatches[0].input_ids.device)
    by_source: dict[int, tuple[torch.Tensor, int]] = {}
    for k, batch in enumerate(microbatches):
        last = k == len(microbatches) - 1
        accumulate = isinstance(model, DistributedDataParallel) and not last
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)  # reduce-scatter at the last microbatch
        # DDP all-reduces at the backward of the step's last microbatch only.
        with _no_sync(model) if accumulate else contextlib.nullcontext():
            nll, tokens = objective_loss(model, batch)
            # Alone, grad_scale is 1 and the gradient is exactly (nll / total)'s.
            share = nll / total if grad_scale == 1.0 else nll / total * grad_scale
            share.backward()
        nll = nll.detach()
        loss += nll
        before, count = by_source.get(batch.source, (torch.zeros_like(nll), 0))
        by_source[batch.source] = (before + nll, count + tokens)
    return StepLoss(loss=loss / total, by_source=by_source)
