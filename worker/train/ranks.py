"""This process's place among a phase's ranks, and the collectives the loop runs over them.

Rank 0 is the only one that speaks to the service (its own ServiceReporter, taking the lease
over from the parent's), evaluates and checkpoints; the others train silently. All ranks hold
the whole model (DDP): rank r takes microbatches r, r+N, r+2N... of each step's `grad_accum`,
the step's loss is weighted over the target tokens of the whole global batch, and gradients
are summed over ranks, so the optimizers see what one device would have seen, to
float-reduction order. Each step ends with rank 0's order (go, pause, preempt, stop) broadcast
to all. A checkpoint of replicated state is rank 0's, written as one device writes it; of a
sharded phase (FSDP2), every rank writes its own shards with torch.distributed.checkpoint into
the step directory rank 0 completes (worker.checkpoint.shards). Either loads on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from worker.error import TrainingError

Order = Literal["go", "pause", "preempt", "stop"]

_CPU = torch.device("cpu")
# What rank 0 sends the ranks in `Ranks.serve_checks`.
_CHECK, _CHOSEN, _FAILED = "check", "chosen", "failed"


@dataclass(frozen=True)
class Ranks:
    """This process's place among the phase's ranks. `Ranks()` is one process alone, where
    every collective is a no-op."""

    rank: int = 0
    world: int = 1
    sharding: Literal["replicate", "fsdp"] = "replicate"
    # Where this rank's collectives run: NCCL reduces CUDA tensors only.
    device: torch.device = _CPU

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether each rank holds a shard of the model (FSDP2): every forward, evals
        included, then runs on every rank, and a checkpoint is gathered from all."""
        return self.world > 1 and self.sharding == "fsdp"

    def share(self, grad_accum: int) -> range:
        """The indices of a step's microbatches this rank computes."""
        return range(self.rank, grad_accum, self.world)

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the forward and backward run through: alone, the model itself; replicated,
        DDP (gradients averaged over ranks at the last microbatch; `grad_scale` turns the
        average into the sum; buffers synced once, at the wrap: every rank computes the same
        ones); sharded, the model itself, each transformer block and then the whole sharded
        in place by FSDP2's `fully_shard` over this rank's device (its parameters become
        DTensors: build the optimizers after this). A model in host memory is moved to the
        device a block at a time as it is sharded."""
        if self.world == 1:
            return model
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            for blocks in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
                for block in blocks:
                    fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model
        return DistributedDataParallel(model, forward_sync_buffers=False)

    @property
    def grad_scale(self) -> float:
        return float(self.world)

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (float64: token counts stay exact)."""
        if self.world == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]

    def seed(self, phase_seed: int) -> int:
        """This rank's seed of the phase's private random streams (dropout): the phase's own
        on rank 0, as on one device, and one of its own on every other rank, so that ranks
        draw different masks for their different microbatches."""
        if self.rank == 0:
            return phase_seed
        return int(np.random.SeedSequence([phase_seed, self.rank]).generate_state(1)[0])

    def gather_random(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's random streams, for rank 0's checkpoint: its own under their names,
        rank r's under `rank<r>/<name>` (elsewhere: {}). Alone: `state` itself."""
        if self.world == 1:
            return state
        gathered: list[dict[str, torch.Tensor]] | None = (
            [{} for _ in range(self.world)] if self.main else None
        )
        dist.gather_object(state, gathered, dst=0)
        if gathered is None:
            return {}
        out = dict(gathered[0])
        for rank, theirs in enumerate(gathered[1:], start=1):
            out.update({f"rank{rank}/{name}": value for name, value in theirs.items()})
        return out

    def own_random(self, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's streams out of a checkpoint's (`gather_random`); none for a rank the
        checkpoint's run did not have (resumed on more ranks): they start from their seed."""
        if self.rank == 0:
            return {k: v for k, v in saved.items() if "/" not in k}
        prefix = f"rank{self.rank}/"
        return {k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)}

    def agree(self, order: Order) -> Order:
        """Rank 0's order, on every rank."""
        if self.world == 1:
            return order
        box: list[Order] = [order]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # Choosing the checkpoint to resume from: rank 0 chooses (worker.checkpoint.resume:
    # select_resume_checkpoint) and has every rank check its share of each candidate at once.

    def check_together(self, path: Path, check: Callable[[Path], str | None]) -> str | None:
        """Rank 0, the others being in `serve_checks`: every rank checks its share of the
        checkpoint at `path` (`check`: the problem it found, or None); the first problem, by
        rank, or None. Alone: `check(path)`."""
        if self.world == 1:
            return check(path)
        dist.broadcast_object_list([(_CHECK, str(path))], src=0)
        return self._first_problem(check(path))

    def serve_checks(self, check: Callable[[Path], str | None]) -> str | None:
        """Every rank but 0: check this rank's share of each checkpoint rank 0 names
        (`check_together`) until it ends its choice (`end_checks`); the path it chose (None:
        none, the phase starts from its initial weights). TrainingError when rank 0 found none
        to start from (it reports why)."""
        while True:
            box: list[tuple[str, str | None]] = [(_FAILED, None)]
            dist.broadcast_object_list(box, src=0)
            what, path = box[0]
            if what == _CHOSEN:
                return path
            if what == _FAILED:
                raise TrainingError("rank 0 found no checkpoint this phase can start from")
            self._first_problem(check(Path(str(path))))

    def end_checks(self, chosen: str | None, *, failed: bool = False) -> None:
        """Rank 0: tell the others in `serve_checks` the checkpoint it chose, or that it
        `failed` to find one it can start from."""
        if self.world > 1:
            dist.broadcast_object_list([(_FAILED if failed else _CHOSEN, chosen)], src=0)

    def _first_problem(self, problem: str | None) -> str | None:
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p is not None), None)


def shard_like(value: Any, param: torch.Tensor) -> Any:
    """`value` (optimizer state of `param`, whole) shaped as `param` is: distributed over the
    same mesh and placements when `param` is a DTensor of its shape, as it is."""
    if (
        isinstance(param, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == param.shape
    ):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value
