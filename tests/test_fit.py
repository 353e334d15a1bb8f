"""Budgets, placement and variant choice on described machines: no real machine is consulted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from localinfer.errors import UsageError
from localinfer.fit import memory, rules
from localinfer.units import parse_size

GiB = 1024 ** 3

# A 7B llama-like model (Q4_K_M ~4.4 GB): 32 layers, 8 KV heads of 128 dims, 32k vocabulary.
LLAMA_7B = memory.ModelFacts(
    architecture="llama", file_size=4_400_000_000, n_layer=32, n_embd=4096, n_ff=14336,
    n_vocab=32_000, kv_dims=(8 * 256,) * 32, swa_layers=(False,) * 32, sliding_window=0,
    repackable_bytes=3_000_000_000, context_length=32768)

MACHINES = {
    "8 GB M1": rules.Machine(8 * GiB, 5 * GiB, apple_silicon=True, metal_working_set=int(5.3 * GiB),
                           repacks=False),
    "16 GB M3": rules.Machine(16 * GiB, 11 * GiB, apple_silicon=True,
                            metal_working_set=int(10.7 * GiB), repacks=False),
    "24 GB x86 + 6 GB GPU": rules.Machine(24 * GiB, 4 * GiB, vram_free=6 * GiB),
    "8 GB x86 laptop": rules.Machine(8 * GiB, 6 * GiB),
    "4 GB x86": rules.Machine(4 * GiB, 3 * GiB),
}


@pytest.mark.parametrize("text, expected", [
    ("4GB", 4_000_000_000), ("512MB", 512_000_000), ("6GiB", 6 * GiB), ("1.5 GB", 1_500_000_000),
    ("2000", 2000), ("300m", 300_000_000), ("0", 0), ("2G", 2_000_000_000), ("1KiB", 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text, "--memory") == expected


@pytest.mark.parametrize("text", ["4XB", "", "lots", "-1GB", "4 G B", "nan", "inf", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError, match=r"--memory='.*' is not a size"):
        parse_size(text, "--memory")


@pytest.mark.parametrize("machine, ram, vram, source", [
    ("8 GB M1", int(5 * GiB), 0, "Metal"),                    # available RAM below working set
    ("16 GB M3", int(10.7 * GiB), 0, "Metal"),
    ("24 GB x86 + 6 GB GPU", int(4 * GiB * 0.9), int(6 * GiB * 0.9), "VRAM"),
    ("8 GB x86 laptop", int(6 * GiB * 0.9), 0, "headroom"),
])
def test_budget(machine, ram, vram, source):
    b = rules.budget(MACHINES[machine])
    assert (b.ram, b.vram) == (ram, vram) and source in b.source


def test_override_wins():
    assert rules.budget(MACHINES["4 GB x86"], 6 * GiB).ram == 6 * GiB


@pytest.mark.parametrize("machine, n_ctx, fits, ctx, kv, gpu_layers", [
    ("16 GB M3", 4096, True, 4096, "f16", 33),           # plenty of unified memory: all on Metal
    ("8 GB x86 laptop", 8192, True, 8192, "f16", 0),
    ("8 GB M1", 32768, True, 8192, "q8_0", 33),          # q8_0 KV, then a shorter context
    ("8 GB x86 laptop", 32768, True, 16384, "q8_0", 0),
    ("24 GB x86 + 6 GB GPU", 32768, True, 32768, "f16", 21),  # 21 layers on the GPU, the rest in RAM
    ("4 GB x86", 4096, False, 512, "q8_0", 0),           # nothing helps: says so
])
def test_place(machine, n_ctx, fits, ctx, kv, gpu_layers):
    m = MACHINES[machine]
    placed = rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=n_ctx)
    assert (placed.fits, placed.n_ctx, placed.kv_type, placed.gpu_layers) == (fits, ctx, kv, gpu_layers)
    if fits and (ctx != n_ctx or kv != "f16"):
        assert placed.notes                     # every change made to fit is said


def test_requested_kv_type_is_kept():
    m = MACHINES["16 GB M3"]
    assert rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=4096, kv_type="q4_0").kv_type == "q4_0"


def test_choose_the_most_precise_variant_that_fits():
    variants = [rules.Candidate("Q8_0", replace(LLAMA_7B, file_size=7_200_000_000), False),
                rules.Candidate("Q4_K_M", LLAMA_7B, True),
                rules.Candidate("F16", replace(LLAMA_7B, file_size=14_500_000_000), False)]
    for machine, expected in (("16 GB M3", "Q8_0"), ("8 GB x86 laptop", "Q4_K_M"), ("4 GB x86", None)):
        m = MACHINES[machine]
        chosen = rules.choose_variant(variants, m, rules.budget(m), n_ctx=4096)
        assert (chosen[0].quant if chosen else None) == expected, machine


def test_not_fitting_message_says_needed_available_and_what_makes_it_fit():
    m = MACHINES["4 GB x86"]
    budget = rules.budget(m)
    line = rules.does_not_fit("llama-7b", LLAMA_7B, m, budget, kv_type=None,
                            smaller_quant="`localinfer quantize`")
    least = rules.place(LLAMA_7B, m, budget, n_ctx=rules.MIN_CTX)
    assert not least.fits and f"needs at least {least.needed / 1e9:.1f} GB" in line
    assert f"{budget.ram / 1e9:.1f} GB is available" in line and "smaller quant" in line
    needed = line.split("a budget of ")[1].split()[0]          # the budget it names is enough
    assert rules.place(LLAMA_7B, m, rules.budget(m, parse_size(needed, "--memory")), n_ctx=4096).fits
    assert "--kv-type q4_0" not in line          # q4_0 KV alone would not make a 7B fit in 2.7 GB


def test_not_fitting_message_offers_q4_0_kv_only_when_it_fits():
    m = MACHINES["8 GB x86 laptop"]
    big_kv = replace(LLAMA_7B, kv_dims=(8 * 8192,) * 32)       # a KV cache 32x the usual
    budget = rules.Budget(5_400_000_000, 0, "test")   # q8_0 at 512 needs 5.65 GB, q4_0 5.11 GB
    assert not rules.place(big_kv, m, budget, n_ctx=4096).fits
    assert rules.place(big_kv, m, budget, n_ctx=rules.MIN_CTX, kv_type="q4_0").fits
    line = rules.does_not_fit("big-kv", big_kv, m, budget, kv_type=None, smaller_quant=None)
    assert "--kv-type q4_0 --ctx 512" in line and "smaller quant" not in line
