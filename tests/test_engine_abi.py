"""The loaded llama.cpp's parameter structs are checked against the bindings before any model
loads (backends/llama/abi.py). A newer llama.cpp can only be imitated here: a library compiled in
the test whose llama_context_default_params returns the struct with one field inserted, as a newer
llama.cpp inserted `moe_cache_size`."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from localinfer.backends.llama import abi

# llama_context_params of the vendored llama.cpp with a 64-bit field after n_seq_max; the
# defaults are the vendored ones, so only the layout differs.
NEWER = r"""
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
struct params {
    uint32_t n_ctx, n_batch, n_ubatch, n_seq_max;
    uint64_t moe_cache_size;
    uint32_t n_rs_seq, n_outputs_max, n_outputs_max_per_seq;
    int32_t n_threads, n_threads_batch;
    int ctx_type, rope_scaling_type, pooling_type, attention_type, flash_attn_type;
    float rope_freq_base, rope_freq_scale, yarn[4];
    uint32_t yarn_orig_ctx;
    float defrag_thold;
    void *cb_eval, *cb_eval_user_data;
    int type_k, type_v;
    void *abort_callback, *abort_callback_data;
    bool embeddings, offload_kqv, no_perf, op_offload, swa_full, kv_unified;
    void *samplers;
    size_t n_samplers;
    void *ctx_other;
};
struct params llama_context_default_params(void) {
    struct params p;
    memset(&p, 0, sizeof p);
    p.n_ctx = 512; p.n_batch = 2048; p.n_ubatch = 512; p.n_seq_max = 1; p.n_outputs_max_per_seq = 1;
    p.type_k = 1; p.type_v = 1; p.offload_kqv = true; p.op_offload = true; p.swa_full = true;
    return p;
}
"""


@pytest.fixture(scope="module")
def bindings():
    from llama_cpp import llama_cpp
    return llama_cpp


@pytest.fixture(scope="module")
def newer_library(tmp_path_factory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the imitation library")
    folder = tmp_path_factory.mktemp("abi")
    (folder / "newer.c").write_text(NEWER)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(folder / "libnewer.so"),
                    str(folder / "newer.c")], check=True)
    return ctypes.CDLL(str(folder / "libnewer.so"))


def test_the_shipped_library_matches_its_bindings(bindings):
    for function, struct, defaults in (
            ("llama_context_default_params", bindings.llama_context_params, abi.CONTEXT_DEFAULTS),
            ("llama_model_default_params", bindings.llama_model_params, abi.MODEL_DEFAULTS)):
        assert abi.struct_problem(bindings._lib, function, struct, defaults) is None
    abi.check(bindings._lib, bindings)


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="64-bit layouts")
def test_a_library_with_an_inserted_field_is_refused(bindings, newer_library):
    problem = abi.struct_problem(newer_library, "llama_context_default_params",
                                 bindings.llama_context_params, abi.CONTEXT_DEFAULTS)
    assert problem is not None and problem.startswith("llama_context_params")
    with pytest.raises(abi.EngineMismatch, match="does not match the bindings"):
        abi.check(newer_library, bindings)
