from __future__ import annotations

import itertools
import math

import pytest

from contracts.workflow import Schedule
from worker.train.schedule import lr_multiplier


def test_warmup_rises_linearly_to_one() -> None:
    schedule = Schedule(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    values = [lr_multiplier(s, total_steps=20, schedule=schedule) for s in range(1, 5)]
    assert values == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_decays_monotonically_to_min_ratio_at_last_step() -> None:
    schedule = Schedule(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    values = [lr_multiplier(s, total_steps=12, schedule=schedule) for s in range(3, 13)]
    assert all(a > b for a, b in itertools.pairwise(values))
    assert values[-1] == pytest.approx(0.1)
    # Halfway through the decay the cosine is at the midpoint between 1 and the floor.
    mid = lr_multiplier(7, total_steps=12, schedule=schedule)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_cosine_without_warmup_starts_near_one() -> None:
    schedule = Schedule(kind="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(1, total_steps=1000, schedule=schedule) == pytest.approx(1.0, abs=1e-4)
    assert lr_multiplier(1000, total_steps=1000, schedule=schedule) == pytest.approx(0.0)


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction() -> None:
    schedule = Schedule(kind="wsd", warmup_steps=2, decay_fraction=0.2, min_lr_ratio=0.0)
    values = [lr_multiplier(s, total_steps=20, schedule=schedule) for s in range(1, 21)]
    assert values[:2] == pytest.approx([0.5, 1.0])
    assert values[2:16] == pytest.approx([1.0] * 14)  # stable until step 16
    assert values[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_wsd_without_decay_stays_flat() -> None:
    schedule = Schedule(kind="wsd", decay_fraction=0.0, min_lr_ratio=0.0)
    assert {lr_multiplier(s, total_steps=5, schedule=schedule) for s in range(1, 6)} == {1.0}


@pytest.mark.parametrize("step", [0, 11])
def test_step_outside_the_phase_is_refused(step: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        lr_multiplier(step, total_steps=10, schedule=Schedule())
