"""Per-task evaluation: token-weighted, target-only cross-entropy over a whole eval file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from contracts.reports import EvalResult
from contracts.workflow import EvalSpec, perplexity
from worker.data import (
    IGNORE_INDEX,
    encode_records,
    encode_texts,
    read_pairs,
    read_texts,
    record_row,
    stack_rows,
    window_row,
)
from worker.error import DataError
from worker.model import special_token_ids
from worker.objective import objective_loss


@dataclass(frozen=True)
class EvalRows:
    rows: list[tuple[np.ndarray, np.ndarray]]  # (input_ids, labels), each at its own length
    records: int
    oversized_records: int
    pad_id: int


def load_eval_rows(tokenizer: Tokenizer, spec: EvalSpec, *, sequence_length: int) -> EvalRows:
    """Rows of an eval file. Supervised records that do not fit `sequence_length` are skipped
    and counted (training refuses them instead); held-out text is cut into windows whose
    targets cover every token after the first exactly once."""
    _, pad_id = special_token_ids(tokenizer)
    if spec.task == "continued_pretrain":
        texts = read_texts(spec.data)
        tokens = encode_texts(tokenizer, texts)
        rows = []
        for start in range(0, max(len(tokens) - 1, 0), sequence_length):
            window = tokens[start : start + sequence_length + 1]
            rows.append(window_row(window, len(window) - 1, pad_id))
        return EvalRows(rows=rows, records=len(texts), oversized_records=0, pad_id=pad_id)
    pairs = read_pairs(spec.data)
    records = encode_records(tokenizer, [(s, t) for _, s, t in pairs])
    fitting = [r for r in records if len(r.ids) <= sequence_length + 1]
    return EvalRows(
        rows=[record_row(r, len(r.ids) - 1, pad_id) for r in fitting],
        records=len(fitting),
        oversized_records=len(records) - len(fitting),
        pad_id=pad_id,
    )


def evaluate_task(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    eval_spec: EvalSpec,
    *,
    sequence_length: int,
    batch_size: int,
    step: int,
    phase: str,
) -> EvalResult:
    """Cross-entropy = total target NLL / total target tokens over the whole file (not a mean
    of batch means), computed by the training objective without gradients."""
    data = load_eval_rows(tokenizer, eval_spec, sequence_length=sequence_length)
    if not data.rows:
        raise DataError(
            f"eval {eval_spec.task!r} ({eval_spec.data}): nothing to evaluate at "
            f"sequence_length {sequence_length} of phase {phase!r} "
            f"({data.oversized_records} records too long)"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    total_tokens = 0
    try:
        with torch.no_grad():
            for start in range(0, len(data.rows), batch_size):
                chunk = data.rows[start : start + batch_size]
                # Pad to the batch's longest row only; padding is never a target.
                length = max(len(inputs) for inputs, _ in chunk)
                batch = stack_rows([_pad(row, length, data.pad_id) for row in chunk])
                nll, tokens = objective_loss(model, batch.to(device))
                total_nll += nll.double()
                total_tokens += tokens
    finally:
        model.train(was_training)
    cross_entropy = total_nll.item() / total_tokens  # CPU-GPU sync, once per task
    return EvalResult(
        task=eval_spec.task,
        step=step,
        phase=phase,
        cross_entropy=cross_entropy,
        perplexity=perplexity(cross_entropy),
        records=data.records,
        target_tokens=total_tokens,
        oversized_records=data.oversized_records,
    )


def _pad(
    row: tuple[np.ndarray, np.ndarray], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    inputs, labels = row
    extra = length - len(inputs)
    return (
        np.pad(inputs, (0, extra), constant_values=pad_id),
        np.pad(labels, (0, extra), constant_values=IGNORE_INDEX),
    )
