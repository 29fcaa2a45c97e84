"""Metric points cut into batches the service takes: at most MAX_POINTS_PER_BATCH points and
MAX_REPORT_BYTES of body each, in order, whatever the names."""

from __future__ import annotations

import json

import pytest

from contracts.reports import (
    MAX_POINTS_PER_BATCH,
    MAX_REPORT_BYTES,
    MetricBatch,
    MetricPoint,
    metric_batches,
)

TOKEN = "t" * 43


def body_bytes(points: list[MetricPoint]) -> int:
    """The body as the worker's client sends it (httpx's JSON) or pydantic writes it, the
    larger."""
    batch = MetricBatch(fencing_token=TOKEN, points=points)
    by_httpx = json.dumps(
        batch.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":")
    ).encode()
    return max(len(by_httpx), len(batch.model_dump_json().encode()))


@pytest.mark.parametrize(
    "name",
    [
        "loss",
        "x" * 200,  # the longest name the service stores
        "ü✓" * 100,  # several bytes a character
        '\x01\n"\\' * 50,  # escaped: \\u0001 is six bytes for one
        "\U0001f600" * 200,  # four bytes each
    ],
)
def test_every_batch_fits_and_the_points_come_back_in_order(name: str) -> None:
    points = [
        MetricPoint(name=f"{name}{step % 3}", step=step, value=-1.2345678901234567e-300)
        for step in range(2_000_000_000, 2_000_012_000)
    ]
    batches = metric_batches(points)
    assert [p for batch in batches for p in batch] == points
    assert all(0 < len(batch) <= MAX_POINTS_PER_BATCH for batch in batches)
    assert all(body_bytes(batch) <= MAX_REPORT_BYTES for batch in batches)
    if name == "loss":  # short names: batches are cut by count alone
        assert [len(b) for b in batches] == [MAX_POINTS_PER_BATCH, MAX_POINTS_PER_BATCH, 2000]
    else:  # long ones by bytes, yet never needlessly small
        assert len(batches) > 12_000 // MAX_POINTS_PER_BATCH
        assert all(body_bytes(b) > MAX_REPORT_BYTES // 2 for b in batches[:-1])


def test_nothing_to_send_is_no_batch() -> None:
    assert metric_batches([]) == []
