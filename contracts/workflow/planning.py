"""The plan of a workflow: its steps and its compute tokens per phase and per data source,
and how much of them is replay, before the first step is taken.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from contracts.workflow.schema import Objective, Role, Workflow


class SourcePlan(BaseModel):
    name: str
    path: str
    objective: Objective
    sequence_length: int
    microbatch_size: int
    weight: float
    # The planned share of the phase's envelope tokens; the realised share is a metric.
    token_share: float
    compute_tokens: int


class PhasePlan(BaseModel):
    name: str
    objective: Objective
    # Plans stored before phases had roles (runs.plan) read as "train", which they were.
    role: Role = "train"
    steps: int
    first_step: int
    last_step: int
    tokens_per_step: int
    compute_tokens: int
    token_share: float
    # Share of this phase's tokens that is replay: its continued_pretrain sources when it is
    # post-training (a supervised or a replay phase), so 1.0 for a replay phase; 0.0 for a
    # pretraining stage.
    replay_token_share: float
    sources: list[SourcePlan]

    @property
    def post_training(self) -> bool:
        """Supervised phases and replay phases; not a pretraining stage."""
        return self.objective != "continued_pretrain" or self.role == "replay"

    def replays(self, source: SourcePlan) -> bool:
        """Whether `source`'s tokens count as replay: continued_pretrain text in a
        post-training phase (a replay phase's, or a supervised phase's mixture replay)."""
        return self.post_training and source.objective == "continued_pretrain"

    @property
    def replay_tokens(self) -> int:
        return sum(s.compute_tokens for s in self.sources if self.replays(s))


class Plan(BaseModel):
    """Totals of a run. Replay is continued_pretrain text trained in a post-training phase:
    every token of a replay phase and every token of a continued_pretrain source of a
    supervised phase (mixture replay) alike.

    - `replay_token_share` = replay_tokens / compute_tokens: the share of ALL compute tokens.
    - `post_training_tokens`: the compute tokens of the supervised phases plus the replay
      phases, that is every phase but the pretraining stages (continued_pretrain phases of
      role "train"), wherever they stand in the run.
    - `post_training_replay_share` = replay_tokens / post_training_tokens.

    For a workflow that is all post-training (the original PR's: five supervised phases and
    four interleaved replay phases "(17.1% of tokens)" from a pretrained checkpoint, 842M
    compute tokens) both shares are the same number, the PR's; with a pretraining stage in the
    run the first is smaller."""

    total_steps: int
    compute_tokens: int
    replay_tokens: int
    post_training_tokens: int
    replay_token_share: float
    post_training_replay_share: float
    phases: list[PhasePlan]

    @model_validator(mode="before")
    @classmethod
    def _fill_stored_totals(cls, data: Any) -> Any:
        # Plans stored on runs before replay phases existed carry neither count, and their
        # replay_token_share is of supervised tokens: recompute the totals from their phases,
        # which hold everything needed (all of their phases are role "train").
        if isinstance(data, dict) and "post_training_tokens" not in data and "phases" in data:
            phases = [PhasePlan.model_validate(p) for p in data["phases"]]
            return {**data, **_totals(phases, int(data["compute_tokens"]))}
        return data


def _totals(phases: list[PhasePlan], compute_tokens: int) -> dict[str, Any]:
    replay = sum(p.replay_tokens for p in phases)
    post = sum(p.compute_tokens for p in phases if p.post_training)
    return {
        "replay_tokens": replay,
        "post_training_tokens": post,
        "replay_token_share": replay / compute_tokens if compute_tokens else 0.0,
        "post_training_replay_share": replay / post if post else 0.0,
    }


def plan(workflow: Workflow) -> Plan:
    """Totals per phase. `compute_tokens` counts envelope tokens (what the GPU processes);
    `token_share` is each phase's fraction of the run's compute tokens, and each source's
    fraction of its phase's."""
    total_tokens = sum(p.steps * p.tokens_per_step for p in workflow.phases)
    phases = []
    for phase, offset in zip(workflow.phases, workflow.phase_offsets(), strict=True):
        tokens = phase.steps * phase.tokens_per_step
        weights = sum(s.weight for s in phase.data)
        sources = [
            SourcePlan(
                **s.model_dump(),
                token_share=s.weight / weights,
                compute_tokens=round(tokens * s.weight / weights),
            )
            for s in phase.sources()
        ]
        replay = 0.0
        if phase.objective != "continued_pretrain" or phase.role == "replay":
            replay = sum(s.token_share for s in sources if s.objective == "continued_pretrain")
        phases.append(
            PhasePlan(
                name=phase.name,
                objective=phase.objective,
                role=phase.role,
                steps=phase.steps,
                first_step=offset + 1,
                last_step=offset + phase.steps,
                tokens_per_step=phase.tokens_per_step,
                compute_tokens=tokens,
                token_share=tokens / total_tokens,
                replay_token_share=replay,
                sources=sources,
            )
        )
    return Plan(
        total_steps=sum(p.steps for p in workflow.phases),
        compute_tokens=total_tokens,
        **_totals(phases, total_tokens),
        phases=phases,
    )
