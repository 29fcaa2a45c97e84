"""The one loss of training and evaluation: summed negative log-likelihood of target tokens.

An eval number is therefore by definition the training loss without gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from worker.data import IGNORE_INDEX, Batch


def objective_loss(model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, int]:
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


@dataclass(frozen=True)
class StepLoss:
    loss: torch.Tensor  # the step's loss (detached): its NLL over its target tokens
    # Per source index present in the step: (summed NLL, target tokens), for per-source metrics.
    by_source: dict[int, tuple[torch.Tensor, int]]


def backward_step(model: PreTrainedModel, microbatches: Sequence[Batch]) -> StepLoss:
    """Accumulate the gradients of one optimizer step and return its loss: the NLL of every
    microbatch over the target tokens of the whole step, so a microbatch weighs by its target
    tokens (not a mean of microbatch means)."""
    total = sum(b.target_tokens for b in microbatches)
    if total == 0:
        raise ValueError("a training step without target tokens")
    loss = torch.zeros((), device=microbatches[0].input_ids.device)
    by_source: dict[int, tuple[torch.Tensor, int]] = {}
    for batch in microbatches:
        nll, tokens = objective_loss(model, batch)
        (nll / total).backward()
        nll = nll.detach()
        loss += nll
        before, count = by_source.get(batch.source, (torch.zeros_like(nll), 0))
        by_source[batch.source] = (before + nll, count + tokens)
    return StepLoss(loss=loss / total, by_source=by_source)
