"""Learning-rate schedules as pure functions of the step."""

from __future__ import annotations

import math

from contracts.workflow import Schedule


def lr_multiplier(step: int, *, total_steps: int, schedule: Schedule) -> float:
    """The multiplier of the base learning rate for the update that completes phase step `step`
    (1-based, 1 .. total_steps). Linear warmup reaches 1.0 at `warmup_steps`; the last step
    lands exactly on `min_lr_ratio`.

    cosine: half a cosine from 1.0 down to min_lr_ratio over the steps after warmup.
    wsd: flat at 1.0, then linear down to min_lr_ratio over the last `decay_fraction` of the
    phase (warmup-stable-decay)."""
    if not 1 <= step <= total_steps:
        raise ValueError(f"step {step} is outside the phase's steps 1..{total_steps}")
    floor = schedule.min_lr_ratio
    warmup = schedule.warmup_steps
    if step <= warmup:
        return step / warmup
    if schedule.kind == "cosine":
        # Progress over the post-warmup steps: 0 just after warmup, 1 at the last step.
        span = total_steps - warmup
        progress = (step - warmup) / span
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = round(schedule.decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if step <= decay_start:
        return 1.0
    return 1.0 - (1.0 - floor) * (step - decay_start) / decay_steps
