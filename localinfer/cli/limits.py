"""Ranges of the option values that reach llama.cpp: the command line refuses values outside them.

Past them llama.cpp aborts the process (100,000 threads: std::bad_alloc), overruns its fixed-size
tables (more than GGML_MAX_N_THREADS threads), truncates (n_ctx is 32 bits in its C structs) or
crawls: ggml's threads spin-wait for one another at every step, so threads beyond the CPUs make
each step far slower (measured on 2 CPUs: 16 threads took 22 s and 64 threads 57 s for what 2 do
in under a second; 512 did not finish in 200 s).
"""

from __future__ import annotations

import os

GGML_MAX_N_THREADS = 512      # ggml.h: the size of the thread pool's tables
# Tokens of context (and of one `eval` chunk, which is also its batch). The longest context any
# model is trained for is 10M tokens (Llama 4 Scout); memory bounds it further at run time.
MAX_CTX = 1 << 24


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def max_threads() -> int:
    return min(usable_cpus(), GGML_MAX_N_THREADS)
