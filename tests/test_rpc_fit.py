"""A model fitted over RPC workers (issue 30, items 2-4): pure placement on described machines.

The layer split is llama.cpp's (llama_model_base::load_tensors), checked here against a plain
transcription of its loop; the fit's choices (what fits, which quant, which device is overfull)
are checked on machines described the way detect_machine would describe them.
"""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest

from localinfer.backends.llama.devices import Device, llama_shares, placed_layers
from localinfer.fit import gpu, memory, rules, spread

GB = 1000 ** 3

LLAMA_70B = memory.ModelFacts(  # a 40 GB Q4_K_M file: 80 layers, 8 KV heads of 128 dims
    architecture="llama", file_size=40 * GB, n_layer=80, n_embd=8192, n_ff=28672,
    n_vocab=128_256, kv_dims=(8 * 256,) * 80, swa_layers=(False,) * 80, sliding_window=0,
    repackable_bytes=0, context_length=131072)


def llama_loop(n: int, frees: list[int]) -> list[int]:
    """llama.cpp's split written as its C++ reads: float splits, summed and normalised in turn,
    then std::upper_bound per layer."""
    f32 = np.float32
    splits, total = [], f32(0)
    for free in frees:
        total = f32(total + f32(free))
        splits.append(total)
    splits = [f32(s / total) for s in splits]
    shares = [0] * len(frees)
    for layer in range(n):
        shares[bisect.bisect_right(splits, f32(f32(layer) / f32(n)))] += 1
    return shares


@pytest.mark.parametrize("seed", range(20))
def test_the_split_is_llama_cpps_for_any_memory(seed):
    rng = random.Random(seed)
    frees = [rng.randrange(1, 64 * GB) for _ in range(rng.randrange(1, 5))]
    n = rng.randrange(1, 130)
    assert llama_shares(n, frees) == llama_loop(n, frees)
    assert sum(llama_shares(n, frees)) == n


def test_workers_come_first_in_llama_cpps_device_order():
    found = [Device("CPU", "a CPU", "cpu", "CPU", 64 * GB, 64 * GB),
             Device("CUDA0", "RTX 4090", "gpu", "CUDA", 20 * GB, 24 * GB),
             Device("RPC0", "10.0.0.2:50052", "gpu", "RPC", 20 * GB, 20 * GB)]
    placed = placed_layers(41, 40, found)
    assert placed.devices == ("RPC0 (10.0.0.2:50052)", "CUDA0 (RTX 4090)")
    assert placed.shares == (21, 20)      # by free memory, 20 GB each: the first takes the odd one
    assert placed.remote


def machine(ram_gb: float, *workers_gb: float, **extra) -> rules.Machine:
    workers = tuple((f"10.0.0.{i + 2}:50052", int(w * GB)) for i, w in enumerate(workers_gb))
    return rules.Machine(ram_total=int(ram_gb * GB), ram_available=int(ram_gb * GB),
                         workers=workers, **extra)


def place(m: rules.Machine, facts=LLAMA_70B, **kwargs) -> rules.Placement:
    return rules.place(facts, m, rules.budget(m), n_ctx=4096, kv_type="f16", **kwargs)


def test_a_model_too_big_for_one_machine_fits_over_two_workers():
    alone = place(machine(24))
    assert not alone.fits
    spread_ = place(machine(24, 24, 24))
    assert spread_.fits and spread_.gpu_layers > 0
    assert spread_.needed <= rules.budget(machine(24, 24, 24)).ram
    assert "worker 10.0.0.2:50052" in spread_.spread and "worker 10.0.0.3:50052" in spread_.spread
    assert any(note.startswith("placed over the workers") for note in spread_.notes)


def test_layers_go_where_the_memory_is():
    """Equal memory everywhere: about a third each; a small worker takes a small share."""
    even = place(machine(30, 30, 30), facts=LLAMA_70B)
    shares = [int(part.split(" on ")[0]) for part in even.spread.split(", ")[1:]]
    cpu_layers = even.layers - even.gpu_layers
    assert abs(cpu_layers - even.layers / 3) <= 2 and all(abs(s - 27) <= 2 for s in shares)
    small = place(machine(40, 4, 30))
    small_share = int(small.spread.split(", ")[1].split(" on ")[0])
    assert small.fits and small_share < 8


def test_each_worker_holds_no_more_than_it_offers():
    for workers in [(3, 40), (12, 12, 12), (1.5, 60)]:
        m = machine(20, *workers)
        placed = place(m)
        devices = [spread.Device(n, f, b, 0)
                   for (n, f), b in zip(m.workers, rules.budget(m).workers)]
        chosen = spread.spread(placed.gpu_layers, devices, 0)   # shares as llama.cpp makes them
        per_layer = (LLAMA_70B.file_size + memory.estimate(
            LLAMA_70B, memory.Request(4096, kv_type="f16")).kv_cache) / placed.layers
        for device, share in zip(devices, chosen.shares):
            assert share * per_layer <= device.budget, (workers, device, share)


def test_the_workers_keep_the_model_at_its_own_quant():
    """Quantize-to-fit sees the set's memory: the Q4_K_M that fits only across the workers wins
    over the Q2_K that would fit this machine alone."""
    q2 = memory.with_quant_size(LLAMA_70B, 20 * GB, 0)
    candidates = [rules.Candidate("Q4_K_M", LLAMA_70B, True), rules.Candidate("Q2_K", q2, False)]
    alone, together = machine(28), machine(28, 24)
    assert rules.choose_variant(candidates, alone, rules.budget(alone), n_ctx=4096)[0].quant == "Q2_K"
    assert rules.choose_variant(candidates, together, rules.budget(together),
                                n_ctx=4096)[0].quant == "Q4_K_M"


def test_a_worker_too_small_for_the_share_asked_is_named_before_anything_loads():
    m = machine(64, 20, 20)
    placed = place(m, gpu_layers=81)        # --gpu-layers: all 40 GB over two 20 GB workers
    assert not placed.fits and "worker 10.0.0.2:50052" in placed.overfull
    line = rules.does_not_fit("llama-70b", LLAMA_70B, m, rules.budget(m), kv_type="f16",
                              smaller_quant=None, gpu_layers=81)
    assert "worker 10.0.0.2:50052 can hold" in line and "--gpu-layers" in line


def test_when_nothing_fits_the_line_says_what_stays_in_ram():
    m = machine(8, 8)
    line = rules.does_not_fit("llama-70b", LLAMA_70B, m, rules.budget(m), kv_type=None,
                              smaller_quant=None)
    assert "layers on the workers" in line and "--memory" in line


def test_a_mac_with_a_worker_holds_its_share_in_unified_memory():
    m = machine(48, 24, apple_silicon=True, metal_working_set=40 * GB)
    placed = place(m)
    assert placed.fits and placed.gpu_layers == placed.layers     # llama.cpp offloads them all
    assert "this Mac's GPU" in placed.spread


def test_a_local_gpu_fills_first_then_the_workers_and_cpu():
    m = machine(32, 24, vram_free=24 * GB)
    placed = place(m)
    assert placed.fits and placed.on_gpu > 0
    assert "the GPU" in placed.spread


def test_devices_names_the_rebuild_with_rpc_and_keeps_the_gpu_backend():
    found = [Device("CUDA0", "RTX", "gpu", "CUDA", GB, GB)]
    line = gpu.rpc_hint(found, python="/venv/bin/python", version="0.3.36")
    assert 'CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on"' in line and "--no-cache-dir" in line
    assert "no RPC backend" in line
