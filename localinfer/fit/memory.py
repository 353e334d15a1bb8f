"""How much memory running a model takes: weights + KV cache + compute buffers + runtime overhead.

Pure functions of a model's facts (read from its GGUF header) and a request, so that placement can
be tested on described machines. Each term follows what llama.cpp (the version we ship) allocates
on a CPU and what of it becomes resident:

- weights: the file is memory-mapped and every page is read, so the whole file counts; on x86 with
  AVX2 some tensor types are also copied into an interleaved ("repacked") layout, which counts twice.
- KV cache: n_ctx cells in every layer. Sliding-window layers get a full-size cache too, because this
  llama.cpp allocates them full size by default (`swa_full`); with swa_full off they are sized by
  their window.
- compute buffer: activations for one full micro-batch plus the attention mask, and the logits rows
  that are really written (llama.cpp reserves n_outputs_max rows of vocabulary-sized floats, but
  pages of rows never written stay untouched and do not count). A full micro-batch is what any
  prompt of 512 tokens or more evaluates, and what every first run of a model does: the exactness
  probe for speculation prefills 320 tokens and verifies batches of up to 8 rows of logits. So the
  estimate is the peak of such runs; a short prompt without drafts peaks a few percent lower.
- overhead: the Python interpreter with numpy and llama.cpp loaded, plus llama.cpp's vocabulary
  tables, which grow with the vocabulary (measured on the build machine; see RUNTIME_* below).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from localinfer.fit import moe
from localinfer.gguf import split as gguf_split
from localinfer.gguf.checks import checked_header
from localinfer.gguf.header import ArrayInfo, Header

MIB = 1 << 20
# Measured on the build machine (x86-64, Python 3.11, llama-cpp-python 0.3.36, typer 0.28): peak
# RSS of a `localinfer run` minus every buffer llama.cpp reports is this constant plus this much per
# token of vocabulary (llama.cpp's token tables and the tokenizer's maps). typer 0.29 would add
# ~15 MB (it imports pydantic). Re-measured 2026-12-04 (61 from 57: the CLI's own modules grew; the
# tiny-architecture runs in tests/test_tiny_archs.py had drifted to -10%).
RUNTIME_BASE = 61 * MIB
RUNTIME_PER_VOCAB_TOKEN = 120
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "f32": 4.0}
KV_PAD = 256                  # llama.cpp rounds the number of KV cells up to this
N_UBATCH = 512                # micro-batch the backend decodes with (LoadOptions.n_batch)
N_OUTPUTS_MAX = 64            # logits rows one decode call returns at most (backends MAX_OUTPUTS)
# Logits rows a `run` writes in one call: speculation verifies up to 8 drafted tokens at once, and
# the one-off exactness probe batches as many (speculate.exactness.MAX_PROBED).
RUN_LOGITS_ROWS = 8
# Live hidden-state rows of one micro-batch at its widest (measured as the resident growth from a
# short to a full batch: 13 MiB on SmolLM2, 17 MiB on Gemma 3 270M): the residual, the normed input
# and the attention or FFN output in n_embd, the gate, up and activated rows in n_ff.
ACTIVATION_ROWS = 3
# Tensor types llama.cpp's CPU backend repacks on x86 with AVX2 when ne[1] % 8 == 0.
REPACKED_X86_AVX2 = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}


@dataclass(frozen=True)
class ModelFacts:
    """What the memory estimate needs to know about one model file."""

    architecture: str
    file_size: int
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    kv_dims: tuple[int, ...]           # per layer: n_head_kv * (head_dim_k + head_dim_v)
    swa_layers: tuple[bool, ...]       # per layer: uses a sliding window
    sliding_window: int
    repackable_bytes: int              # bytes of tensors the CPU backend may repack
    context_length: int
    # Per layer: bytes of its mixture-of-experts tensors (fit.moe); empty or zeros for dense models.
    expert_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Request:
    n_ctx: int
    kv_type: str = "f16"
    logits_rows: int = RUN_LOGITS_ROWS  # rows of logits written per call: 8 for run, 64 for eval
    swa_full: bool = True              # the llama.cpp default in this version
    repack: bool = True                # x86 with AVX2 (see devices)


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv_cache: int
    compute: int
    overhead: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Peak resident memory when memory is plentiful (what `ps` shows)."""
        return self.weights + self.kv_cache + self.compute + self.overhead

    @property
    def required(self) -> int:
        """What must fit: the mapped originals of repacked weights are clean file pages that are
        never read again, so the kernel reclaims them under memory pressure."""
        return self.total - self.parts.get("repacked", 0)

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "compute": self.compute,
                "overhead": self.overhead, "total": self.total, "required": self.required,
                **self.parts}


# -- facts from a GGUF header ----------------------------------------------------------------------
def facts_from_file(path: Path) -> ModelFacts:
    # Checked: block_count, head counts and sizes are whole numbers in llama.cpp's ranges. A split
    # model counts the bytes and tensors of all its parts.
    return facts_from_header(*gguf_split.whole_model(path, checked_header(path)))


def facts_from_header(header: Header, file_size: int) -> ModelFacts:
    meta = header.metadata
    arch = str(meta.get("general.architecture", "llama"))

    def key(name: str, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_layer = int(key("block_count", 0))
    n_embd = int(key("embedding_length", 0))
    n_head = _per_layer(key("attention.head_count", 1), n_layer)
    n_head_kv = _per_layer(key("attention.head_count_kv", key("attention.head_count", 1)), n_layer)
    head_k = key("attention.key_length")
    head_v = key("attention.value_length")
    # A model without attention (Mamba, RWKV) has 0 heads, and no KV cache to size.
    kv_dims = tuple(kv * (int(head_k or n_embd // h) + int(head_v or n_embd // h)) if h else 0
                    for kv, h in zip(n_head_kv, n_head))
    window = int(key("attention.sliding_window", 0) or 0)
    return ModelFacts(
        architecture=arch, file_size=file_size, n_layer=n_layer, n_embd=n_embd,
        n_ff=max(_per_layer(key("feed_forward_length", 4 * n_embd), n_layer) + [_moe_ff(key)]),
        n_vocab=_vocab_size(meta), kv_dims=kv_dims,
        swa_layers=_swa_layers(arch, n_layer, window, key("attention.sliding_window_pattern")),
        sliding_window=window, repackable_bytes=_repackable(header),
        context_length=int(key("context_length", 0) or 0),
        expert_bytes=moe.expert_bytes(header.tensors, n_layer))


def _per_layer(value, n_layer: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)] * n_layer


def _moe_ff(key) -> int:
    # A mixture of experts computes the FFN of each token in every expert it routes to: a
    # micro-batch's widest rows are expert_used_count expert FFNs (llama.cpp's MoE graph).
    used = key("expert_used_count", 0)
    used = max(used, default=0) if isinstance(used, list) else int(used or 0)
    return used * int(key("expert_feed_forward_length", 0) or 0)


def _vocab_size(meta: dict) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    return tokens.length if isinstance(tokens, ArrayInfo) else len(tokens or [])


def _swa_layers(arch: str, n_layer: int, window: int, pattern) -> tuple[bool, ...]:
    if not window:
        return (False,) * n_layer
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern)
    # Gemma 2 alternates; Gemma 3 has one global layer after every five local ones.
    period = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2}.get(
        arch, int(pattern or 0))
    if not period:
        return (True,) * n_layer
    return tuple((il + 1) % period != 0 for il in range(n_layer))


def _repackable(header: Header) -> int:
    # Only weights multiplied in a MUL_MAT are repacked; token_embd is read by rows (GET_ROWS).
    return sum(t.n_bytes for t in header.tensors
               if t.type_name in REPACKED_X86_AVX2 and len(t.shape) >= 2
               and t.shape[1] % 8 == 0 and t.shape[0] % 8 == 0
               and not t.name.startswith("token_embd"))


# -- the estimate ----------------------------------------------------------------------------------
def estimate(facts: ModelFacts, request: Request) -> Estimate:
    weights = facts.file_size + (facts.repackable_bytes if request.repack else 0)
    kv = kv_cache_bytes(facts, request)
    logits = request.logits_rows * facts.n_vocab * 4
    compute = _activations(facts, request) + logits + logits   # compute rows + output buffer copy
    overhead = RUNTIME_BASE + RUNTIME_PER_VOCAB_TOKEN * facts.n_vocab
    parts = {"repacked": facts.repackable_bytes if request.repack else 0, "logits": 2 * logits}
    return Estimate(weights, kv, compute, overhead, parts)


def kv_cells(facts: ModelFacts, request: Request, swa: bool) -> int:
    cells = -(-request.n_ctx // KV_PAD) * KV_PAD
    if swa and not request.swa_full:
        window = -(-(facts.sliding_window + N_UBATCH) // KV_PAD) * KV_PAD
        cells = min(cells, window)
    return cells


def kv_cache_bytes(facts: ModelFacts, request: Request) -> int:
    per_value = KV_TYPE_BYTES[request.kv_type]
    return int(sum(kv_cells(facts, request, swa) * dims * per_value
                   for dims, swa in zip(facts.kv_dims, facts.swa_layers)))


def _activations(facts: ModelFacts, request: Request) -> int:
    # One full micro-batch of f32 hidden states at the widest point of a layer, plus the f16
    # attention mask over all cells (flash attention is on for CPU: no n_ctx x n_ctx scores).
    cells = -(-request.n_ctx // KV_PAD) * KV_PAD
    return N_UBATCH * ACTIVATION_ROWS * (facts.n_embd + facts.n_ff) * 4 + cells * N_UBATCH * 2


def with_extra_weights(facts: ModelFacts, extra: int) -> ModelFacts:
    """The model with `extra` bytes held beside its weights (a multimodal projector)."""
    return replace(facts, file_size=facts.file_size + extra) if extra else facts


def with_quant_size(facts: ModelFacts, file_size: int, repackable_bytes: int) -> ModelFacts:
    """The same model at another quantization (sizes from a quantization plan); its experts take
    the same share of the file as before."""
    share = file_size / facts.file_size if facts.file_size else 0
    return replace(facts, file_size=file_size, repackable_bytes=repackable_bytes,
                   expert_bytes=tuple(int(b * share) for b in facts.expert_bytes))


def cpu_repacks() -> bool:
    """Whether this CPU's llama.cpp backend repacks weights (x86 with AVX2, where the engine loads
    into its extra weight buffers: not on AMX CPUs, backends/llama/devices.uses_weight_buffers)."""
    from localinfer.backends.llama.devices import uses_weight_buffers
    from localinfer import machine
    return "avx2" in machine.cpu_flags() and uses_weight_buffers()


def planned_facts(source: ModelFacts, plan) -> ModelFacts:
    """The facts of the file a quantization plan (quant.quantize.QuantPlan) would write: the same
    model with the plan's sizes."""
    # The plan knows target types but not shapes; count the types the CPU backend repacks.
    repackable = sum(t.size for t in plan.tensors if t.target_type in REPACKED_X86_AVX2
                     and not t.name.startswith("token_embd"))
    return with_quant_size(source, plan.file_size, repackable)
