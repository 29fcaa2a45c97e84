"""The token ledger of a phase: per data source, the tokens trained so far, as the service's
ledger (`GET /runs/{id}/ledger`) reads them back against the plan.

Reported at every step, cumulative over the phase's steps 1 .. phase_step (the names:
contracts.ledger):

- `tokens/<source>`: envelope tokens (what the plan counts: the source's microbatches x its
  `sequence_length x microbatch_size`);
- `target_tokens/<source>`: the target tokens the loss was taken over;
- `epochs/<source>`: how many times the steps went through the source (worker.data.batch
  .epochs_seen).

Envelope tokens and epochs are pure functions of the step, as the batches are. Target tokens
depend on what the batches held, so they are carried in each checkpoint (its LEDGER part,
worker.checkpoint.layout) and go on from there on resume; the claim deleted every point after
the checkpoint's step, so each series continues exactly as an uninterrupted run's. A
checkpoint written before they were counted carries none: the phase then reports none rather
than a count that is short.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from contracts.ledger import ledger_series
from worker.data.batch import PhaseData, epochs_seen

log = logging.getLogger(__name__)


class TokenLedger:
    """Counts of one phase on one rank (every rank counts alike: the loss's sums are over all
    ranks). `tokens_seen`: envelope tokens over the whole run, as checkpoints carry it."""

    def __init__(
        self,
        data: PhaseData,
        *,
        seed: int,
        phase_index: int,
        tokens_seen: int,
        target_tokens: Mapping[str, int] | None,
    ) -> None:
        self._data = data
        self._seed = seed
        self._phase_index = phase_index
        self._names = data.names()
        self._envelopes = [
            s.geometry.sequence_length * s.geometry.microbatch_size for s in data.sources
        ]
        self.tokens_seen = tokens_seen
        self._targets: list[int] | None = None
        if target_tokens is not None:
            self._targets = [int(target_tokens.get(name, 0)) for name in self._names]
        else:
            log.warning(
                "the checkpoint resumed from holds no target tokens per source (written by an "
                "older worker): this phase reports none"
            )

    def add(self, tokens_per_step: int, targets: Mapping[int, int]) -> None:
        """One step done: `targets`, the target tokens of each source it held, by index."""
        self.tokens_seen += tokens_per_step
        if self._targets is not None:
            for index, count in targets.items():
                self._targets[index] += count

    def target_tokens(self) -> dict[str, int] | None:
        """What a checkpoint of this step carries (None: not counted)."""
        if self._targets is None:
            return None
        return dict(zip(self._names, self._targets, strict=True))

    def metrics(self, phase_step: int) -> dict[str, float]:
        """The ledger's points at `phase_step`, every source's."""
        counts = self._data.counts[phase_step * self._data.grad_accum]
        epochs = epochs_seen(
            self._data, seed=self._seed, phase_index=self._phase_index, phase_step=phase_step
        )
        out: dict[str, float] = {}
        for i, name in enumerate(self._names):
            series = ledger_series(name)
            out[series.tokens] = float(int(counts[i]) * self._envelopes[i])
            if self._targets is not None:
                out[series.target_tokens] = float(self._targets[i])
            out[series.epochs] = epochs[i]
        return out
