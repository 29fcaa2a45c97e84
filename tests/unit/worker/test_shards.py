"""Which rank verifies which file of a sharded checkpoint (worker.checkpoint.shards.verifier_of)."""

from __future__ import annotations

from worker.checkpoint.shards import SHARDS, SHARDS_METADATA, verifier_of


def test_a_shard_file_is_verified_by_the_rank_that_wrote_it_every_other_by_rank_0() -> None:
    written_by = [f"{SHARDS}/__{k}_0.distcp" for k in range(4)]
    assert [verifier_of(name, 4) for name in written_by] == [0, 1, 2, 3]
    # On fewer ranks than wrote it, in turn; alone, every file.
    assert [verifier_of(name, 2) for name in written_by] == [0, 1, 0, 1]
    assert [verifier_of(name, 1) for name in written_by] == [0, 0, 0, 0]
    assert verifier_of(f"{SHARDS}/__13_2.distcp", 8) == 5
    for name in (SHARDS_METADATA, "model.safetensors", "optimizer.pt", "__1_0.distcp"):
        assert verifier_of(name, 4) == 0, name
