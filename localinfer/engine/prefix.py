"""What the KV cache's prefill shares with its variants (engine/media.py): the longest common
prefix of two token sequences, and the event the prompt cache reports for `-v`. Re-exported by
engine/kv.py, where they were first written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class CacheEvent:
    """What the prompt cache did for the last prefill, for `-v`."""

    hit: bool
    restored: int = 0          # tokens whose KV state came from disk
    seconds: float = 0.0       # reading, verifying and restoring it
    note: str = ""             # why nothing was restored


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared start of two token sequences.

    Called every round of speculation over the whole context, so it compares list slices (in C)
    and bisects towards the first difference instead of walking token by token.
    """
    a, b = (x if isinstance(x, list) else list(x) for x in (a, b))
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 16:            # a[:lo] == b[:lo]; the first difference lies in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo
