"""Tiny random-weight projectors (mmproj GGUF) in the layouts libmtmd reads, and SmolLM2 with
SmolVLM's image tokens: test material for the multimodal path without a vision model.

    from mmproj_writer import write_idefics3, write_ultravox, smolvlm_text_model
    text = smolvlm_text_model(SMOLLM2_GGUF, tmp / "smolvlm-text.gguf")
    vision = write_idefics3(tmp / "mmproj-vision.gguf")
    audio = write_ultravox(tmp / "mmproj-audio.gguf")

- idefics3 (SmolVLM's projector): a SigLIP-style tower (patch embedding, learned positions, pre-norm
  blocks, post-norm), pixel shuffle by `clip.vision.projector.scale_factor`, one linear map into
  576 wide embeddings (`mm.model.fc.weight`); images are resized to a longest edge and cut into
  tiles of `clip.vision.image_size`, each tile (and an overview) its own set of tokens.
- ultravox: a Whisper-style encoder (two 1-D convolutions over 80 mel bins, learned positions,
  blocks whose K has no bias), frames stacked by 4, an RMS-normed SwiGLU projection into 576
  (by 8 libmtmd counts one token fewer than its graph makes for a 30 s window, and aborts).

libmtmd wraps each idefics3 image in SmolVLM's own tokens (`<fake_token_around_image>`,
`<global-img>`, `<row_R_col_C>`), which SmolLM2's vocabulary lacks (their ids would be -1):
`smolvlm_text_model` copies SmolLM2 with them appended, their embedding rows ordinary tokens'
rows negated, as SmolVLM's language model is SmolLM2 with those tokens added.

Random weights say nothing about what a model sees or hears: never use these for a quality
claim. They pin the mechanics (chunks, positions, the KV cache, the tokens chosen) against
llama.cpp's own llama-mtmd-cli. Seeded: the same call writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TEXT_WIDTH = 576                 # SmolLM2-135M's embedding width
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def _rand(rng: np.random.Generator, *shape: int, scale: float = 0.05) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _block(writer, rng, prefix: str, il: int, n_embd: int, n_ff: int, *, k_bias: bool) -> None:
    """One pre-norm transformer block (ln1, q/k/v/out, ln2, up/down) of a ViT or Whisper tower."""
    def add(name: str, data: np.ndarray) -> None:
        writer.add_tensor(f"{prefix}.blk.{il}.{name}", data)
    for norm in ("ln1", "ln2"):
        add(f"{norm}.weight", np.ones(n_embd, np.float32))
        add(f"{norm}.bias", np.zeros(n_embd, np.float32))
    for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
        add(f"{proj}.weight", _rand(rng, n_embd, n_embd))
        if proj != "attn_k" or k_bias:
            add(f"{proj}.bias", _rand(rng, n_embd, scale=0.01))
    add("ffn_up.weight", _rand(rng, n_ff, n_embd))
    add("ffn_up.bias", _rand(rng, n_ff, scale=0.01))
    add("ffn_down.weight", _rand(rng, n_embd, n_ff))
    add("ffn_down.bias", _rand(rng, n_embd, scale=0.01))


def _common(writer, modality: str, n_embd: int, n_ff: int, n_layer: int, n_head: int) -> None:
    writer.add_string("general.name", f"tiny random {modality} projector (tests only)")
    writer.add_uint32("general.file_type", 0)
    writer.add_bool(f"clip.has_{modality}_encoder", True)
    writer.add_uint32(f"clip.{modality}.embedding_length", n_embd)
    writer.add_uint32(f"clip.{modality}.feed_forward_length", n_ff)
    writer.add_uint32(f"clip.{modality}.block_count", n_layer)
    writer.add_uint32(f"clip.{modality}.projection_dim", TEXT_WIDTH)
    writer.add_uint32(f"clip.{modality}.attention.head_count", n_head)
    writer.add_float32(f"clip.{modality}.attention.layer_norm_epsilon", 1e-6)


def write_idefics3(path: Path, *, image_size: int = 32, patch_size: int = 4, longest_edge: int = 64,
                   scale_factor: int = 2, n_embd: int = 32, n_layer: int = 2,
                   seed: int = 46) -> Path:
    """SmolVLM's projector, tiny: tiles of `image_size` pixels in patches of `patch_size`,
    `scale_factor`**2 patches shuffled into one token ((image_size/patch_size/scale_factor)**2
    tokens a tile), images resized to `longest_edge` and cut into tiles plus an overview."""
    import gguf
    rng = np.random.default_rng(seed)
    n_ff, n_patches = 2 * n_embd, (image_size // patch_size) ** 2
    writer = gguf.GGUFWriter(str(path), "clip")
    _common(writer, "vision", n_embd, n_ff, n_layer, n_head=2)
    writer.add_string("clip.projector_type", "idefics3")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.preproc_image_size", longest_edge)
    writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_tensor("v.patch_embd.weight", _rand(rng, n_embd, 3, patch_size, patch_size, scale=0.2))
    writer.add_tensor("v.patch_embd.bias", _rand(rng, n_embd, scale=0.01))
    writer.add_tensor("v.position_embd.weight", _rand(rng, n_patches, n_embd, scale=0.2))
    for il in range(n_layer):
        _block(writer, rng, "v", il, n_embd, n_ff, k_bias=True)
    writer.add_tensor("v.post_ln.weight", np.ones(n_embd, np.float32))
    writer.add_tensor("v.post_ln.bias", np.zeros(n_embd, np.float32))
    writer.add_tensor("mm.model.fc.weight",
                      _rand(rng, TEXT_WIDTH, n_embd * scale_factor ** 2, scale=0.05))
    return _finish(writer, path)


def write_ultravox(path: Path, *, n_embd: int = 32, n_layer: int = 1, n_mel: int = 80,
                   stack: int = 4, seed: int = 47) -> Path:
    """An Ultravox-style audio projector, tiny: Whisper's front (30 s windows of 16 kHz audio,
    3000 mel frames, halved by the second convolution) and frames stacked by `stack`."""
    import gguf
    rng = np.random.default_rng(seed)
    n_ff, n_pos = 2 * n_embd, 1500
    writer = gguf.GGUFWriter(str(path), "clip")
    _common(writer, "audio", n_embd, n_ff, n_layer, n_head=2)
    writer.add_string("clip.projector_type", "ultravox")
    writer.add_uint32("clip.audio.num_mel_bins", n_mel)
    writer.add_uint32("clip.audio.projector.stack_factor", stack)
    # Conv1d weights as ggml reads them: [kernel, in, out]; biases broadcast along time.
    writer.add_tensor("a.conv1d.1.weight", _rand(rng, n_embd, n_mel, 3, scale=0.1))
    writer.add_tensor("a.conv1d.1.bias", _rand(rng, n_embd, 1, scale=0.01))
    writer.add_tensor("a.conv1d.2.weight", _rand(rng, n_embd, n_embd, 3, scale=0.1))
    writer.add_tensor("a.conv1d.2.bias", _rand(rng, n_embd, 1, scale=0.01))
    writer.add_tensor("a.position_embd.weight", _rand(rng, n_pos, n_embd, scale=0.2))
    for il in range(n_layer):
        _block(writer, rng, "a", il, n_embd, n_ff, k_bias=False)
    writer.add_tensor("a.post_ln.weight", np.ones(n_embd, np.float32))
    writer.add_tensor("a.post_ln.bias", np.zeros(n_embd, np.float32))
    stacked = n_embd * stack
    writer.add_tensor("mm.a.norm_pre.weight", np.ones(stacked, np.float32))
    writer.add_tensor("mm.a.mlp.1.weight", _rand(rng, 2 * n_embd, stacked, scale=0.2))
    writer.add_tensor("mm.a.norm_mid.weight", np.ones(n_embd, np.float32))
    writer.add_tensor("mm.a.mlp.2.weight", _rand(rng, TEXT_WIDTH, n_embd, scale=0.05))
    return _finish(writer, path)


def _finish(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _negated(rows: np.ndarray, qtype) -> np.ndarray:
    """Rows of Q8_0 embeddings negated (each block: an f16 scale, 32 int8 quants): new tokens
    whose logits never tie with their donors' through the tied output layer."""
    import gguf
    if qtype != gguf.GGMLQuantizationType.Q8_0:
        raise ValueError(f"token_embd of type {qtype.name}: only Q8_0 is handled")
    blocks = rows.reshape(len(rows), -1, 34).copy()
    blocks[:, :, 2:] = (-blocks[:, :, 2:].view(np.int8)).view(np.uint8)
    return blocks.reshape(rows.shape)


def smolvlm_text_model(source: Path, path: Path) -> Path:
    """`source` (SmolLM2) copied with IMAGE_TOKENS appended to its vocabulary as control tokens;
    their embedding rows are ordinary tokens' rows negated (the output layer is tied to them)."""
    import gguf
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    n_old = len(reader.fields["tokenizer.ggml.tokens"].data)
    n_new = n_old + len(IMAGE_TOKENS)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = [*value, *IMAGE_TOKENS]
        elif field.name == "tokenizer.ggml.token_type":
            value = [*value, *[3] * len(IMAGE_TOKENS)]       # LLAMA_TOKEN_TYPE_CONTROL
        elif field.name == f"{arch}.vocab_size":
            value = n_new
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "token_embd.weight":
            data = np.concatenate([data, _negated(data[1000:1000 + len(IMAGE_TOKENS)],
                                                  tensor.tensor_type)])
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    return _finish(writer, path)
