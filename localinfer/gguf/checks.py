"""What llama.cpp asserts on rather than refuses, checked before a GGUF file reaches it.

llama.cpp's GGUF reader refuses a malformed file with an error, but its model and vocabulary
loaders check a few values with GGML_ASSERT, which aborts the whole process (exit 134). So such a
file ends in one ModelLoadError line instead: `check_model` before llama.cpp loads a model or its
vocabulary (and for `info`), `checked_header` (the same without the vocabulary scan) before the
quantizer, which reads no vocabulary, and before our memory estimate computes with the values.
References are to the llama.cpp vendored in llama-cpp-python 0.3.36.

Hyper-parameters that disagree with tensor shapes are left to llama.cpp: it compares every tensor it
creates with them (llama-model-loader.cpp check_tensor_dims) and refuses cleanly, naming the tensor.
"""

from __future__ import annotations

import functools
import math
import mmap
import re
import struct
from pathlib import Path

from localinfer.errors import ModelLoadError
from localinfer.gguf import split as gguf_split
from localinfer.gguf.header import (ArrayInfo, CorruptFile, Header, TextInfo, check_tensors,
                                    file_identity, printable, read_header)

MAX_LAYERS = 512                  # LLAMA_MAX_LAYERS (src/llama-hparams.h)
MAX_EXPERTS = 1024                # LLAMA_MAX_EXPERTS
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")   # LLAMA_ROPE_SCALING_TYPES
# Keys our own code computes with (memory estimate, info): whole numbers, or one per layer.
_COUNTS = ("block_count", "context_length", "embedding_length", "attention.key_length",
           "attention.value_length", "attention.sliding_window", "expert_count")
_PER_LAYER = ("feed_forward_length", "attention.head_count", "attention.head_count_kv",
              "expert_used_count")
_TOKENS = "tokenizer.ggml.tokens"
_SPECIAL_ID = re.compile(r"tokenizer\.ggml\.\w+_token_id")
_STRING = 8                       # GGUF value type of strings
_U64 = struct.Struct("<Q").unpack_from


def check_model(path: Path) -> Header:
    """The header of a model file llama.cpp can load without aborting; ModelLoadError otherwise.

    For every path that hands the file to llama.cpp's model or vocabulary loader.
    """
    header = checked_header(path)
    offset, n = _token_array(header)
    if n:
        duplicate = _first_duplicate(Path(path), file_identity(path), offset, n)
        if duplicate is not None:
            raise refusal(path, f"token {duplicate} repeats an earlier token's text")
    return header


def checked_header(path: Path) -> Header:
    """The header, its hyper-parameters, tensor shapes and special token ids checked: what the
    quantizer (which does not read the vocabulary) and our own estimates need. Cheap: no scan.
    For the first part of a split model, every other part's header is read and checked too; the
    header returned is the first part's (gguf_split.whole_model counts all parts' tensors)."""
    header = read_header(path)
    try:
        gguf_split.part_paths(path, header)   # a later part named alone: say which file to load
        check_hparams(header.metadata)
        check_tensors(header)
        check_special_tokens(header.metadata, vocabulary_size(header))
        gguf_split.check_parts(path, header)  # every other part of a split model, before llama.cpp
    except CorruptFile as e:
        raise refusal(path, str(e)) from None
    return header


def refusal(path: Path, reason: str) -> ModelLoadError:
    """The one line for a file the checks refuse (CorruptFile's reason)."""
    return ModelLoadError(f"cannot load {Path(path).name}: {reason} (a damaged file, or one not "
                          "made for llama.cpp)")


# -- hyper-parameters ------------------------------------------------------------------------------
def check_hparams(meta) -> int:
    """The number of layers, after checking the values llama.cpp's load_hparams asserts on."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch.isprintable() or len(arch) > 64:
        raise CorruptFile("general.architecture is missing or not a name")
    if not isinstance(meta.get("general.name", ""), str):     # info shows it
        raise CorruptFile("general.name is not a name")
    for name in _COUNTS:
        _count(meta, f"{arch}.{name}")
    n_layer = _count(meta, f"{arch}.block_count")
    # llama-model.cpp load_hparams: GGML_ASSERT(n_layer_all > 0 && n_layer_all <= LLAMA_MAX_LAYERS).
    # The quantizer (llama-quant.cpp) asserts the same. Without the key llama.cpp refuses cleanly.
    if n_layer is not None and not 0 < n_layer <= MAX_LAYERS:
        raise CorruptFile(f"{arch}.block_count is {n_layer}; llama.cpp allows 1 to {MAX_LAYERS} "
                          "layers")
    n_layer = n_layer or 0
    for name in _PER_LAYER:
        _per_layer(meta, f"{arch}.{name}", n_layer)
    # GGML_ASSERT(n_layer_nextn <= n_layer_all): the multi-token-prediction layers are among them.
    nextn = _count(meta, f"{arch}.nextn_predict_layers") or 0
    if nextn > n_layer:
        raise CorruptFile(f"{arch}.nextn_predict_layers is {nextn}, more than its {n_layer} layers")
    # GGML_ASSERT(rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED): an unknown name.
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise CorruptFile(f"{arch}.rope.scaling.type is {_show(scaling)}, not one of "
                          f"{', '.join(ROPE_SCALING_TYPES)}")
    check_experts(meta, arch)
    check_reals(meta, arch, n_layer)
    return n_layer


def check_experts(meta, arch: str) -> None:
    """The mixture-of-experts counts, as load_hparams asserts them one by one."""
    n_expert = _count(meta, f"{arch}.expert_count") or 0
    used = meta.get(f"{arch}.expert_used_count", 0)
    used_max = max(used, default=0) if isinstance(used, list) else used
    groups = _count(meta, f"{arch}.expert_group_count") or 0
    group_used = _count(meta, f"{arch}.expert_group_used_count") or 0
    problem = None
    if n_expert > MAX_EXPERTS:
        problem = f"expert_count is {n_expert}, more than llama.cpp's {MAX_EXPERTS}"
    elif used_max > n_expert:
        problem = f"expert_used_count is {used_max}, more than its {n_expert} experts"
    elif n_expert and not used_max:
        problem = f"expert_used_count is 0 with {n_expert} experts"
    elif groups and groups >= n_expert:
        problem = f"expert_group_count is {groups} with {n_expert} experts"
    elif groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        problem = f"{groups} expert groups ({group_used} used) do not divide {n_expert} experts"
    if problem:
        raise CorruptFile(f"{arch}.{problem}")


def _count(meta, key: str) -> int | None:
    value = meta.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise CorruptFile(f"{key} is {_show(value)}, not a whole number")
    return value


def _per_layer(meta, key: str, n_layer: int) -> None:
    # llama-model-loader.cpp get_key_or_arr: one number for all layers, or exactly one per layer.
    value = meta.get(key)
    if value is None or not isinstance(value, (list, ArrayInfo)):
        _count(meta, key)
        return
    if isinstance(value, ArrayInfo) or len(value) != n_layer:
        length = value.length if isinstance(value, ArrayInfo) else len(value)
        raise CorruptFile(f"{key} has {length} values for {n_layer} layers")
    if any(type(v) is not int or v < 0 for v in value):
        raise CorruptFile(f"{key} holds a value that is not a whole number")


def _show(value) -> str:
    if isinstance(value, (list, ArrayInfo)):
        return "an array"
    if isinstance(value, TextInfo):
        return f"a text of {value.length} bytes"
    return repr(value) if not isinstance(value, str) else repr(printable(value, 40))


# -- real-valued hyper-parameters ------------------------------------------------------------------
# Every real-valued key llama.cpp's model loaders read (src/llama-arch.cpp, read in llama-model.cpp
# load_hparams and src/models/*.cpp), with the range a working model has. ggml aborts on a negative
# or NaN norm epsilon (ggml-cpu/ops.cpp norm, rms_norm, group_norm: GGML_ASSERT(eps >= 0.0f)); the
# others abort nothing but make every backend compute NaN or nonsense: a rope base of 1 or less
# (its logarithm divides the YaRN correction, its powers are the frequencies), a negative rope
# scaling factor (llama.cpp takes 0 for "none"), a zero attention soft-cap (logits / cap), a NaN
# or infinity anywhere. Keys without a known range must at least be finite.
_REAL_RULES = {
    "epsilon": (lambda v: 0 <= v < 1, "a norm epsilon from 0 up to 1"),
    "base": (lambda v: v > 1, "a rope base above 1"),
    "positive": (lambda v: v > 0, "a finite number above 0"),
    "non-negative": (lambda v: v >= 0, "a finite number, 0 or more"),
    "finite": (lambda v: True, "a finite number"),
}
_REALS = {
    "epsilon": ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon",
                "attention.group_norm_epsilon", "hyper_connection.epsilon"),
    "base": ("rope.freq_base", "rope.freq_base_swa", "attention.compress_rope_freq_base"),
    "positive": ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor",
                 "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                 "attn_logit_softcapping"),
    "non-negative": ("rope.scaling.factor", "rope.scale_linear", "rope.scaling.alpha",
                     "final_logit_softcapping", "router_logit_softcapping",
                     "expert_weights_scale", "expert_group_scale", "attention.scale",
                     "attention.clamp_kqv", "attention.max_alibi_bias"),
    "finite": ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier", "logit_scale",
               "residual_scale", "embedding_scale", "attention.output_scale",
               "attention.value_scale", "attention.temperature_scale", "activation.situ_beta",
               "activation.situ_linear_beta", "hyper_connection.magnitude"),
}
# Read with get_key_or_arr: one number for all layers or one per layer (xIELU's keys carry no
# architecture prefix, and its epsilon is negative in real models: not a norm epsilon).
_REALS_PER_LAYER = ("{arch}.swiglu_clamp_exp", "{arch}.swiglu_clamp_shexp", "xielu.alpha_n",
                    "xielu.alpha_p", "xielu.beta", "xielu.eps")


def check_reals(meta, arch: str, n_layer: int) -> None:
    """Every real-valued hyper-parameter finite and in its range, for every backend alike."""
    for rule, names in _REALS.items():
        for name in names:
            key = f"{arch}.{name}"
            value = meta.get(key)
            if value is not None:
                if isinstance(value, (list, ArrayInfo)):   # llama.cpp reads one number
                    raise CorruptFile(f"{key} is an array, not {_REAL_RULES[rule][1]}")
                _real(key, value, rule)
    for pattern in _REALS_PER_LAYER:
        key = pattern.format(arch=arch)
        value = meta.get(key)
        if isinstance(value, (list, ArrayInfo)):
            length = value.length if isinstance(value, ArrayInfo) else len(value)
            if isinstance(value, ArrayInfo) or length != n_layer:
                raise CorruptFile(f"{key} has {length} values for {n_layer} layers")
            for v in value:
                _real(key, v, "finite")
        elif value is not None:
            _real(key, value, "finite")


def _real(key: str, value, rule: str) -> None:
    in_range, words = _REAL_RULES[rule]
    if type(value) is not float:        # llama.cpp reads a float32 and refuses other types too
        raise CorruptFile(f"{key} is {_show(value)}, not a real number")
    if not math.isfinite(value) or not in_range(value):
        raise CorruptFile(f"{key} is {_show(value)}, not {words}")


# -- vocabulary ------------------------------------------------------------------------------------
def check_special_tokens(meta, n_vocab: int | None) -> None:
    """Every special token id (bos, eos, eot, pad, ...) names a token of the vocabulary.

    llama-vocab.cpp load: an id outside it is logged as "bad special token" and replaced by the
    tokenizer's default, possibly none; an `add_bos` model without BOS then aborts when text is
    tokenized with special tokens (GGML_ASSERT(special_bos_id != LLAMA_TOKEN_NULL)).
    """
    if n_vocab is None:
        return
    for key, value in meta.items():
        if _SPECIAL_ID.fullmatch(key) and (type(value) is not int or not 0 <= value < n_vocab):
            raise CorruptFile(f"{key} is {_show(value)}, not a token of its {n_vocab:,}-token "
                              "vocabulary")


def vocabulary_size(header: Header) -> int | None:
    """The number of tokens; None for a file without a vocabulary.

    llama-vocab.cpp load refuses anything but an array of strings (cleanly); our own code would
    take its length first, so it is refused here.
    """
    tokens = header.metadata.get(_TOKENS)
    if tokens is None:
        return None
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        return len(tokens)
    if isinstance(tokens, ArrayInfo) and tokens.element_type == _STRING:
        return tokens.length
    raise CorruptFile(f"{_TOKENS} is not a list of strings")


def _token_array(header: Header) -> tuple[int, int]:
    """File offset of the first token and the number of tokens (0 without a vocabulary)."""
    n = vocabulary_size(header) or 0
    return header.array_offsets.get(_TOKENS, 0), n


@functools.lru_cache(maxsize=8)
def _first_duplicate(path: Path, _identity: tuple[int, ...], offset: int, n: int) -> int | None:
    """The id of the first token whose text an earlier token has, or None.

    llama-vocab.cpp load maps each text to its id and then asserts that the map is as long as the
    vocabulary (GGML_ASSERT(id_to_token.size() == token_to_id.size())): a repeated text aborts. An
    empty text counts as "[EMPTY_<id>]", as llama.cpp renames it. One pass over the strings into a
    set of their bytes (20 MB for Gemma 3's 262,144 tokens), a second only for a file that fails;
    remembered per unchanged file, since a `run` checks the same file more than once.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if len(set(_texts(buf, offset, n))) == n:
            return None
        seen: set[bytes] = set()
        for token_id, text in enumerate(_texts(buf, offset, n)):
            if text in seen:
                return token_id
            seen.add(text)
    return None


def _texts(buf, pos: int, n: int):
    for token_id in range(n):
        length = _U64(buf, pos)[0]
        pos += 8
        yield buf[pos:pos + length] or b"[EMPTY_%d]" % token_id
        pos += length
