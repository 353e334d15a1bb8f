"""The prefill batching rules that keep prompt-cache restores exact (see localinfer/batching.py)."""

import pytest

from localinfer.engine.batching import (GRAIN, batch_ends, canonical_end, restore_limit,
                                        snapshot_ends)


@pytest.mark.parametrize("start,n,expected", [
    (0, 512, [512]),                       # pp512: one batch
    (0, 100, [100]),
    (0, 1100, [512, 1024, 1100]),
    (0, 1050, [512, 960, 1050]),           # the last batch would be 26 long: cut earlier
    (64, 600, [512, 600]),                 # from a restored state
    (128, 1200, [640, 1088, 1200]),
])
def test_free_prompts_go_in_full_batches_whose_last_is_never_short(start, n, expected):
    ends = batch_ends(start, n, 512, window=0)
    assert ends == expected
    sizes = [b - a for a, b in zip([start, *ends], ends)]
    assert all(size <= 512 for size in sizes)
    assert sizes[-1] >= GRAIN or len(sizes) == 1


def test_rigid_prompts_cut_at_checkpoints_and_at_the_tail():
    # A sliding-window model with a 512-token window and a prompt that outgrows it.
    assert batch_ends(0, 1100, 512, window=512) == [512, 1024, 1088, 1100]
    assert snapshot_ends(0, 1100, 512, window=512) == [512, 1024, 1088]
    assert batch_ends(320, 1100, 512, window=512) == [512, 1024, 1088, 1100]
    assert batch_ends(0, 1100, 256, window=512) == [256, 512, 768, 1024, 1088, 1100]
    # Within the window the same model is cut like any other.
    assert batch_ends(0, 500, 512, window=512) == [500]
    assert snapshot_ends(0, 500, 512, window=512) == [500]


def test_restore_points_leave_a_full_last_batch():
    assert restore_limit(512, 0) == 448
    assert restore_limit(513, 0) == 448
    assert restore_limit(100, 0) == 0
    assert restore_limit(1100, 512) == 1088     # rigid: up to the tail cut
    assert canonical_end(1100, 0) == 1100
    assert canonical_end(1100, 512) == 1088
    assert canonical_end(50, 0) == 0
