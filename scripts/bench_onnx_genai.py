#!/usr/bin/env python3
"""Our ONNX decode loop against onnxruntime-genai's C++ loop running the same exported graph.

`localinfer bench --backend onnx` drives the dynamic graph (GroupQueryAttention, accuracy level 4)
from Python; onnxruntime-genai drives a graph from C++. Giving genai *our* export separates the cost
of our host loop (IOBinding, numpy, sampling in Python) from the cost of the graph itself. Issue
target: our decode >= 0.95x genai's.

What genai gets: the same weights file (hard-linked) and a copy of our graph file where only the
inputs genai cannot feed are replaced (nine tiny shape ops added), the compute graph left as it is:
- seqlens_k, total_sequence_length: genai feeds an attention_mask [1, total] instead; they are
  computed from it as genai's own model builder does (ReduceSum - 1, Shape[1], cast to int32).
- logits_from: Shape(input_ids)[1] - 1, the last row, which is what our prefill and decode ask for.
  The logits output is declared [1, 1, vocab], so genai knows the graph returns only the last row
  (its "pruned" logits) and does not preallocate [1, S, vocab].
- the rope tables (cos/sin, which our runner binds once as inputs): baked in as initializers, the
  same float32 rows onnx_runner.rope_tables makes for the same context.
The KV cache is genai's shared past/present buffer [1, n_kv, max_length, head_dim] with max_length
= our context (prompt + gen + 16, as `localinfer bench` sets it), so both sides see the same
layout. No sliding_window entry: like our backend, genai keeps every position and the graph's
local_window_size does the masking. genai is driven with token ids only (no tokenizer files); the
prompt is the same 512 ids `localinfer bench` uses (localinfer.measure.bench._prompt_tokens).
Checked by hand: genai's greedy ids on this copy equal OnnxSession's (12 of 12, both models).

genai runs in its own venv (made once by scripts/llama_tools.py, onnxruntime pinned to our version so both sides run
the same ORT build) as a child process: this script started with --genai-child.

Measured like `localinfer bench`: per process one warm-up and `-r` repetitions, medians; prefill =
512 ids into an empty cache (time of append_tokens), decode = 128 greedy steps after the first
token from a one-token prompt (min_length = max_length, so EOS never stops it). Rounds alternate
which side goes first. On a shared machine a process's figures swing by tens of percent with the
load of others (the load average is in the table): read the medians of several rounds.

Usage:

    python scripts/bench_onnx_genai.py smollm2 gemma-3-270m --rounds 5 [-t 2] [--json]

Progress goes to stderr; the markdown table (or JSON with --json) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # scripts/common.py
import llama_tools  # scripts/llama_tools.py: the cache and its venvs

GENAI_VERSION = "0.18.0"      # the newest on the index; runs on onnxruntime 1.32.0 (needs >= 1.31)
VENV = "genai-venv"            # in the scripts' cache (llama_tools.cache_root())
KEYS = ("prefill_tps", "decode_tps")


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the genai side: runs in the venv, imports only onnxruntime_genai and numpy --------------------
def genai_child(folder: str, n_gen: int, repetitions: int) -> None:
    import numpy as np
    import onnxruntime_genai as og
    prompt = np.array(json.loads((Path(folder) / "prompt.json").read_text()), np.int32)
    model = og.Model(og.Config(folder))
    prefill, decode = [], []
    for rep in range(repetitions + 1):          # rep 0 warms caches and is not counted
        gen = og.Generator(model, og.GeneratorParams(model))   # search options: genai_config.json
        start = time.perf_counter()
        gen.append_tokens(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - start))
        gen = og.Generator(model, og.GeneratorParams(model))
        gen.append_tokens(prompt[:1])
        gen.generate_next_token()               # the first token: sampled from the prefill logits
        start = time.perf_counter()
        for _ in range(n_gen):                  # each: one model run on the last token + sampling
            gen.generate_next_token()
        decode.append(n_gen / (time.perf_counter() - start))
    print(json.dumps({"prefill_tps": statistics.median(prefill[1:]),
                      "decode_tps": statistics.median(decode[1:]), "version": og.__version__}))


# -- preparing genai's folder ------------------------------------------------------------------------
def export(model: str, n_prompt: int, n_ctx: int) -> dict:
    """Our export of `model` (made or reused in the store) and what genai's config needs."""
    from localinfer.backends.onnx import arch as onnx_arch, export as onnx_export, runner as onnx_runner
    from localinfer.backends.llama.vocab import LlamaVocab
    from localinfer.backends.onnx.export import export_root
    from localinfer.measure.bench import _prompt_tokens
    from localinfer.gguf.header import read_header
    path = common.model_file(model, notify=note)
    header = read_header(path)
    spec = onnx_arch.read_spec(path, header)
    folder, index = onnx_export.ensure_weights(path, header, spec, export_root(), note=note)
    graph = onnx_export.ensure_graph(folder, index, spec, onnx_export.Form("dynamic", 4))
    factors = index.vector(folder, "rope_freqs.weight") if spec.rope_factors else None
    vocab = LlamaVocab(path)
    try:
        ids = {"prompt": _prompt_tokens(vocab, n_prompt), "bos": vocab.bos_token,
               "eos": vocab.eos_token}
    finally:
        vocab.close()
    return {"spec": spec, "graph": graph, "n_ctx": n_ctx, **ids,
            "tables": onnx_runner.rope_tables(spec, n_ctx, factors)}


def genai_graph(graph: Path, tables: dict, target: Path) -> None:
    """A copy of our graph that genai can feed (see the module docstring); weights stay external."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    m = onnx.load(str(graph), load_external_data=False)
    g = m.graph
    computed = {"seqlens_k", "total_sequence_length", "logits_from", *tables}
    kept = [i for i in g.input if i.name not in computed]
    del g.input[:]
    g.input.extend(kept + [helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                                         [1, "total"])])
    consts = {"genai.one": np.array([1], np.int64), "genai.one_scalar": np.array(1, np.int64)}
    g.initializer.extend(numpy_helper.from_array(v, k) for k, v in {**consts, **tables}.items())
    i32 = TensorProto.INT32
    nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "genai.one"], ["genai.filled"], keepdims=0),
        helper.make_node("Sub", ["genai.filled", "genai.one"], ["genai.seqlens"]),
        helper.make_node("Cast", ["genai.seqlens"], ["seqlens_k"], to=i32),
        helper.make_node("Shape", ["attention_mask"], ["genai.mask_shape"]),
        helper.make_node("Gather", ["genai.mask_shape", "genai.one_scalar"], ["genai.total"]),
        helper.make_node("Cast", ["genai.total"], ["total_sequence_length"], to=i32),
        helper.make_node("Shape", ["input_ids"], ["genai.ids_shape"]),
        helper.make_node("Gather", ["genai.ids_shape", "genai.one"], ["genai.new"]),
        helper.make_node("Sub", ["genai.new", "genai.one"], ["logits_from"]),
    ]
    old = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old)                  # topological order: the new nodes feed the old
    logits = next(o for o in g.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].Clear()
    logits.type.tensor_type.shape.dim[1].dim_value = 1
    target.write_bytes(m.SerializeToString())


def genai_config(info: dict, threads: int, file_name: str) -> dict:
    spec, n_ctx = info["spec"], info["n_ctx"]
    # genai takes trailing pad ids for padding: pick an id the prompt does not hold.
    pad = next(t for t in (info["eos"], 0, 1, 2) if t is not None and t not in info["prompt"])
    return {"model": {
        "type": "gemma3_text" if spec.gemma else "llama", "context_length": n_ctx,
        "vocab_size": spec.n_vocab, "bos_token_id": info["bos"], "eos_token_id": info["eos"],
        "pad_token_id": pad,
        "decoder": {
            "filename": file_name, "head_size": spec.head_dim, "hidden_size": spec.n_embd,
            "num_attention_heads": spec.n_head, "num_key_value_heads": spec.n_kv,
            "num_hidden_layers": spec.n_layer,
            # as onnx_runner.session_options: intra threads, one inter thread, errors only
            "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1,
                                "log_severity_level": 3, "provider_options": []},
            "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                       "past_key_names": "past_key_%d", "past_value_names": "past_value_%d"},
            "outputs": {"logits": "logits", "present_key_names": "present_key_%d",
                        "present_value_names": "present_value_%d"}}},
        "search": {"max_length": n_ctx, "min_length": n_ctx, "do_sample": False, "num_beams": 1,
                   "past_present_share_buffer": True}}


def prepare(model: str, folder: Path, args) -> None:
    """genai's folder: config, graph copy, the weights linked in, the prompt ids."""
    info = export(model, args.prompt, args.prompt + args.gen + 16)
    genai_graph(info["graph"], info["tables"], folder / "model.onnx")
    link_weights(info["graph"].parent / "weights.bin", folder / "weights.bin")
    config = genai_config(info, args.threads, "model.onnx")
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    (folder / "prompt.json").write_text(json.dumps(info["prompt"]))


def link_weights(source: Path, target: Path) -> None:
    """A hard link (ORT resolves symlinks and refuses external data outside the model's folder);
    a copy where the store is on another file system."""
    try:
        os.link(source, target)
    except OSError:
        note(f"copying {source} (another file system: no hard link)")
        shutil.copyfile(source, target)


def ensure_venv() -> Path:
    """The venv with onnxruntime-genai, onnxruntime pinned to the project's own version."""
    from importlib.metadata import version
    want = [f"onnxruntime-genai=={GENAI_VERSION}", f"onnxruntime=={version('onnxruntime')}"]
    ready = ("import onnxruntime_genai, onnxruntime, sys; "
             f"sys.exit(onnxruntime_genai.__version__ != '{GENAI_VERSION}' or "
             f"onnxruntime.__version__ != '{version('onnxruntime')}')")
    return llama_tools.ensure_venv(VENV, [*want, "numpy"], ready)


# -- measuring -------------------------------------------------------------------------------------
def run_genai(python: Path, folder: Path, args) -> dict:
    cmd = [str(python), __file__, "--genai-child", str(folder), "-n", str(args.gen),
           "-r", str(args.repetitions)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: onnxruntime-genai on {folder}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_ours(model: str, args) -> dict:
    """Medians of one `localinfer bench --backend onnx` process (as scripts/bench_onnx.py)."""
    cmd = [sys.executable, "-m", "localinfer", "bench", model, "--backend", "onnx", "--offline",
           "-p", str(args.prompt), "-n", str(args.gen), "-r", str(args.repetitions),
           "-t", str(args.threads), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])}: {done.stderr.strip().splitlines()[-1]}")
    result = json.loads(done.stdout)
    return {k: result[k]["median"] for k in KEYS}


def compare(model: str, python: Path, args) -> list[dict]:
    rounds = []
    with tempfile.TemporaryDirectory(prefix="genai-", dir=llama_tools.cache_root()) as tmp:
        prepare(model, Path(tmp), args)
        for i in range(args.rounds):
            order = ("genai", "ours") if i % 2 == 0 else ("ours", "genai")
            load = os.getloadavg()[0]
            figures = {side: run_genai(python, Path(tmp), args) if side == "genai"
                       else run_ours(model, args) for side in order}
            row = {"model": model, "round": i + 1, "first": order[0], "loadavg": round(load, 2),
                   **{f"{s}_{k}": round(figures[s][k], 2) for s in order for k in KEYS},
                   **{f"ratio_{k}": round(figures["ours"][k] / figures["genai"][k], 3)
                      for k in KEYS}}
            note(f"{model} round {i + 1}: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                                         if k not in ("model", "round")))
            rounds.append(row)
    return rounds


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(rounds: list[dict], args) -> str:
    from importlib.metadata import version
    head = [f"`{' '.join(['python', *sys.argv])}` — {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{cpu_model()} ({os.cpu_count()} logical CPUs), {args.threads} threads, "
            f"onnxruntime {version('onnxruntime')} on both sides, onnxruntime-genai "
            f"{GENAI_VERSION}; pp {args.prompt} tokens, tg {args.gen} tokens, medians of "
            f"{args.repetitions} runs per process; ratio = ours / genai", "",
            "| model | round | first | load avg | genai pp t/s | ours pp t/s | ratio | "
            "genai tg t/s | ours tg t/s | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        head.append(f"| {r['model']} | {r['round']} | {r['first']} | {r['loadavg']} | "
                    f"{r['genai_prefill_tps']} | {r['ours_prefill_tps']} | "
                    f"{r['ratio_prefill_tps']} | {r['genai_decode_tps']} | "
                    f"{r['ours_decode_tps']} | {r['ratio_decode_tps']} |")
    for model in dict.fromkeys(r["model"] for r in rounds):
        mine = [r for r in rounds if r["model"] == model]
        pp, tg = (statistics.median(r[f"ratio_{k}"] for r in mine) for k in KEYS)
        head.append(f"| **{model}** | median | | | | | **{pp:.3f}** | | | **{tg:.3f}** |")
    return "\n".join(head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=0, help="0: one per physical core")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--genai-child", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.genai_child:
        return genai_child(args.genai_child, args.gen, args.repetitions)
    if not args.models:
        ap.error("name at least one model")
    if not args.threads:            # what `localinfer bench` picks, given to both sides explicitly
        from localinfer.machine import default_threads
        args.threads = default_threads()
    try:
        python = ensure_venv()
    except llama_tools.BenchError as e:
        raise SystemExit(f"error: {e}") from None
    rounds = [r for m in args.models for r in compare(m, python, args)]
    print(json.dumps(rounds, indent=2) if args.json else table(rounds, args))


if __name__ == "__main__":
    main()
