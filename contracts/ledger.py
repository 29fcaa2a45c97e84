"""The token ledger's metric series: what a worker reports at every step for each data source
of its phase (worker.train.ledger) and the service reads back against the plan
(`GET /runs/{id}/ledger`). Each is cumulative over the phase's steps, so its last point in the
phase's steps is the phase's count so far.
"""

from __future__ import annotations

from typing import NamedTuple


class LedgerSeries(NamedTuple):
    """The metric names of one source's counts."""

    tokens: str  # envelope tokens: the source's microbatches x sequence_length x microbatch_size
    target_tokens: str  # the tokens its loss was taken over
    epochs: str  # how many times the steps went through the source


def ledger_series(source: str) -> LedgerSeries:
    return LedgerSeries(f"tokens/{source}", f"target_tokens/{source}", f"epochs/{source}")
