"""Mixtures of experts on a GPU too small for them (issue 27, section 3): the fit keeps the experts
of as many layers as needed in host memory, every other tensor on the GPU, as llama.cpp's
--n-cpu-moe does; --cpu-moe N overrides the count.

The decisions are pure functions, tested here on described machines with the facts of real files
(sizes from their GGUF headers as published; the experts' share worked out from their tensor
types). The table in docs/gpu.md is this test's output.
"""

from __future__ import annotations

import pytest

from localinfer.backends.llama.devices import Device
from localinfer.errors import UsageError
from localinfer.fit import gpu, memory, moe, rules
from localinfer.gguf.header import Tensor

GiB = 1024 ** 3
# Qwen3-30B-A3B Q4_K_M: 48 layers of 128 experts (8 used), each 2048 x 768; gate and up Q4_K,
# down Q6_K in every other layer (Q4_K_M's mix), 4 KV heads of 128 dims, 151,936 tokens.
_Q4K, _Q6K = 2048 * 768 * 128 * 144 // 256, 2048 * 768 * 128 * 210 // 256
QWEN3_30B_A3B = memory.ModelFacts(
    architecture="qwen3moe", file_size=18_556_686_208, n_layer=48, n_embd=2048, n_ff=768,
    n_vocab=151_936, kv_dims=(4 * 256,) * 48, swa_layers=(False,) * 48, sliding_window=0,
    repackable_bytes=12_000_000_000, context_length=40960,
    expert_bytes=tuple(2 * _Q4K + (_Q6K if il % 2 else _Q4K) for il in range(48)))
# gpt-oss-20b MXFP4: 24 layers of 32 experts (4 used), each 2880 x 2880 in MXFP4 (17 bytes per 32
# weights), 8 KV heads of 64 dims, a 128-token window in every other layer, 201,088 tokens.
GPT_OSS_20B = memory.ModelFacts(
    architecture="gpt-oss", file_size=12_109_566_560, n_layer=24, n_embd=2880, n_ff=2880,
    n_vocab=201_088, kv_dims=(8 * 128,) * 24, swa_layers=tuple(il % 2 == 0 for il in range(24)),
    sliding_window=128, repackable_bytes=10_000_000_000, context_length=131072,
    expert_bytes=(3 * 2880 * 2880 * 32 * 17 // 32,) * 24)
MOE_MODELS = {"Qwen3-30B-A3B Q4_K_M": QWEN3_30B_A3B, "gpt-oss-20b MXFP4": GPT_OSS_20B}


def cpu(total: int) -> Device:
    return Device("CPU", "a CPU", "cpu", "CPU", total, total)


def cuda(name: str, free: float, total: float) -> Device:
    return Device("CUDA0", name, "gpu", "CUDA", int(free * GiB), int(total * GiB))


# name -> (RAM total, RAM available, the engine's devices)
MACHINES = {
    "32 GB + 8 GB RTX 4060": (32 * GiB, 26 * GiB, [cpu(32 * GiB), cuda("RTX 4060", 7.5, 8)]),
    "32 GB + 12 GB RTX 3060": (32 * GiB, 26 * GiB, [cpu(32 * GiB), cuda("RTX 3060", 11.3, 12)]),
    "32 GB + 16 GB RTX 4080": (32 * GiB, 26 * GiB, [cpu(32 * GiB), cuda("RTX 4080", 15.2, 16)]),
    "64 GB + 2 GB MX550": (64 * GiB, 56 * GiB, [cpu(64 * GiB), cuda("MX550", 0.8, 2)]),
}


def machine(name: str) -> rules.Machine:
    total, available, devices = MACHINES[name]
    vram, _ = gpu.memory_of(devices, apple_silicon=False)
    return rules.Machine(total, available, vram_free=vram, repacks=True)


# machine, model, context -> fits, layers on the GPU (of n_layer + 1), layers whose experts stay in
# RAM, context, KV type
DECISIONS = [
    # 8 GB: the attention and shared weights of all 48 layers fit; 33 layers' experts stay in RAM.
    ("32 GB + 8 GB RTX 4060", "Qwen3-30B-A3B Q4_K_M", 4096, True, 49, 33, 4096, "f16"),
    ("32 GB + 8 GB RTX 4060", "Qwen3-30B-A3B Q4_K_M", 32768, True, 49, 40, 32768, "f16"),
    # At 128k the KV cache alone outgrows the GPU: whole layers stay on the CPU, as for a dense model.
    ("32 GB + 8 GB RTX 4060", "Qwen3-30B-A3B Q4_K_M", 131072, True, 13, 0, 131072, "q8_0"),
    ("32 GB + 8 GB RTX 4060", "gpt-oss-20b MXFP4", 4096, True, 25, 13, 4096, "f16"),
    ("32 GB + 12 GB RTX 3060", "gpt-oss-20b MXFP4", 4096, True, 25, 4, 4096, "f16"),
    ("32 GB + 12 GB RTX 3060", "Qwen3-30B-A3B Q4_K_M", 4096, True, 49, 23, 4096, "f16"),
    # 16 GB holds gpt-oss-20b whole at 4k; at 128k its KV cache pushes 10 layers' experts out.
    ("32 GB + 16 GB RTX 4080", "gpt-oss-20b MXFP4", 4096, True, 25, 0, 4096, "f16"),
    ("32 GB + 16 GB RTX 4080", "gpt-oss-20b MXFP4", 131072, True, 25, 10, 131072, "f16"),
    ("32 GB + 16 GB RTX 4080", "Qwen3-30B-A3B Q4_K_M", 4096, True, 49, 12, 4096, "f16"),
    # Not even the attention and shared weights fit 0.8 GB: whole layers stay on the CPU instead.
    ("64 GB + 2 GB MX550", "Qwen3-30B-A3B Q4_K_M", 4096, True, 1, 0, 4096, "f16"),
]


@pytest.mark.parametrize("name, model, n_ctx, fits, layers, cpu_moe, ctx, kv", DECISIONS)
def test_experts_stay_in_ram_as_needed(name, model, n_ctx, fits, layers, cpu_moe, ctx, kv):
    m = machine(name)
    budget = rules.budget(m)
    facts = MOE_MODELS[model]
    placed = rules.place(facts, m, budget, n_ctx=n_ctx)
    assert (placed.fits, placed.gpu_layers, placed.cpu_moe, placed.n_ctx, placed.kv_type) == \
        (fits, layers, cpu_moe, ctx, kv)
    assert placed.on_gpu <= budget.vram and placed.needed <= budget.ram
    if cpu_moe:     # the fewest: one layer's experts fewer would not fit the GPU
        fewer = rules.place(facts, m, budget, n_ctx=n_ctx, cpu_moe=cpu_moe - 1)
        assert fewer.on_gpu > budget.vram


def test_a_dense_model_is_placed_as_before():
    from test_gpu_fit import LLAMA_7B
    m = machine("32 GB + 8 GB RTX 4060")
    placed = rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=32768)
    assert placed.cpu_moe == 0 and 0 < placed.gpu_layers < 33


@pytest.mark.parametrize("asked, cpu_moe", [(0, 0), (5, 5), (48, 48), (1000, 48)])
def test_cpu_moe_option_fixes_the_count(asked, cpu_moe):
    m = machine("32 GB + 8 GB RTX 4060")
    placed = rules.place(QWEN3_30B_A3B, m, rules.budget(m), n_ctx=4096, cpu_moe=asked)
    assert (placed.cpu_moe, placed.gpu_layers) == (cpu_moe, 49)


def test_cpu_moe_with_gpu_layers():
    m = machine("32 GB + 8 GB RTX 4060")
    placed = rules.place(QWEN3_30B_A3B, m, rules.budget(m), n_ctx=4096, cpu_moe=20,
                         gpu_layers=30)
    assert (placed.cpu_moe, placed.gpu_layers) == (20, 30)


def test_cpu_moe_on_a_cpu_only_machine_is_passed_on():
    """Everything is in RAM anyway: the override changes nothing, and is still what was asked."""
    m = rules.Machine(32 * GiB, 26 * GiB)
    placed = rules.place(QWEN3_30B_A3B, m, rules.budget(m), n_ctx=4096, cpu_moe=3)
    assert (placed.cpu_moe, placed.gpu_layers) == (3, 0)
    assert rules.place(QWEN3_30B_A3B, m, rules.budget(m), n_ctx=4096).cpu_moe == 0


def test_cpu_moe_on_a_dense_model_is_a_usage_error():
    from test_gpu_fit import LLAMA_7B
    m = machine("32 GB + 8 GB RTX 4060")
    with pytest.raises(UsageError, match="--cpu-moe applies to mixture-of-experts models"):
        rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=4096, cpu_moe=2)
    assert rules.place(LLAMA_7B, m, rules.budget(m), n_ctx=4096, cpu_moe=0).fits


@pytest.mark.parametrize("value, count", [("auto", None), (None, None), ("0", 0), ("12", 12),
                                          (" 7 ", 7)])
def test_cpu_moe_count(value, count):
    assert moe.cpu_moe_count(value) == count


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "99999999", "", "٣"])
def test_bad_cpu_moe_count(value):
    with pytest.raises(UsageError, match="^--cpu-moe must be"):
        moe.cpu_moe_count(value)


def test_expert_bytes_from_tensor_names():
    tensors = [Tensor("blk.0.ffn_up_exps.weight", "Q4_K", 0, 100, 0),
               Tensor("blk.0.ffn_down_exps.bias", "F32", 0, 7, 0),
               Tensor("blk.1.ffn_gate_exps.weight", "Q4_K", 0, 50, 0),
               Tensor("blk.1.ffn_gate_inp.weight", "F32", 0, 9, 0),     # the router stays
               Tensor("blk.1.ffn_up_shexp.weight", "Q4_K", 0, 9, 0),    # a shared expert stays
               Tensor("blk.1.attn_q.weight", "Q4_K", 0, 9, 0),
               Tensor("blk.9.ffn_up_exps.weight", "Q4_K", 0, 9, 0)]     # past block_count
    assert moe.expert_bytes(tensors, 3) == (107, 50, 0)


def test_the_refusal_says_where_the_experts_went():
    m = rules.Machine(16 * GiB, 8 * GiB, vram_free=int(7.5 * GiB))
    line = rules.does_not_fit("qwen3-30b", QWEN3_30B_A3B, m, rules.budget(m), kv_type=None,
                              smaller_quant="Q3_K_M")
    assert "with 49 of 49 layers on the GPU (experts of " in line
    assert "of 48 layers in host memory)" in line


def test_a_quantized_variant_keeps_the_experts_share():
    half = memory.with_quant_size(QWEN3_30B_A3B, QWEN3_30B_A3B.file_size // 2, 0)
    assert sum(half.expert_bytes) == pytest.approx(sum(QWEN3_30B_A3B.expert_bytes) / 2, rel=1e-6)
