#!/usr/bin/env python3
"""The ONNX backend's quality on the CPU provider, as one markdown table per run:

- top-1 agreement and mean (and max) KL against an independent float64 forward of the same GGUF
  weights (tests/onnx_reference.py), over the first N teacher-forced tokens of the bundled `eval`
  text, for ONNX at accuracy level 0 (exact float32), at level 4 (int8 activations, the default
  of `--backend onnx`) and for the llama.cpp backend beside them, on both of its x86 kernel
  paths: plain, and "repacked" (the file's Q4_0/Q4_K/IQ4_NL/Q2_K/MXFP4 matrices in llama.cpp's
  CPU_REPACK buffer, as an AVX2/AVX-512 CPU without AMX loads them by default), with each
  engine's p99.9 error on the difference of the top logit and the next four (what a greedy
  parting can hide: tests/onnx_reference.py PARTING_TOLERANCE);
- `localinfer eval` perplexity with `--backend llama.cpp` and `--backend onnx` on the same file,
  text, context and chunks, and their relative difference (the target: within 1%).

Usage:

    python scripts/onnx_quality.py smollm2 gemma-3-270m [--tokens 512] [--ctx 512] [--chunks 4]

Progress goes to stderr, the table to stdout. The float64 forward is imported from tests/ (put on
sys.path here) rather than copied, so the script and the tests measure against one reference.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import common  # noqa: E402  (scripts/, beside this file)

common.use_tests()
from onnx_reference import Float64Model, kl  # noqa: E402

from localinfer.backends import LoadOptions  # noqa: E402
from localinfer.measure import quality  # noqa: E402

ENGINES = ("onnx a0", "onnx a4", "llama.cpp", "llama.cpp repacked")
# What ggml-cpu/repack.cpp repacks on x86-64 (AVX2; Q2_K with AVX-512): 2-D weights only.
REPACKED_TYPES = ("Q4_0", "Q4_K", "IQ4_NL", "Q2_K", "MXFP4")
PIECE = quality.PIECE    # rows per eval call and per KL reduction: flat memory on 262k vocabularies


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def open_session(path: Path, engine: str, n_ctx: int):
    """A fresh session of one engine on the file, with a context that holds all the tokens."""
    options = LoadOptions(n_ctx=n_ctx, n_batch=n_ctx)
    if engine.startswith("llama.cpp"):
        from localinfer.backends.llama.session import LlamaCppSession
        if engine == "llama.cpp repacked":
            with repacked(path):
                return LlamaCppSession(path, options)
        return LlamaCppSession(path, options)
    from localinfer.backends.onnx.session import OnnxOptions, OnnxSession
    return OnnxSession(path, options, OnnxOptions(accuracy=int(engine[-1])))


class _Override(ctypes.Structure):          # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@contextlib.contextmanager
def repacked(path: Path):
    """llama.cpp loads the file's repackable matrices into the CPU_REPACK buffer type while this
    is on, through tensor_buft_overrides (which skip AMX): the kernel path of a CPU without AMX,
    on any x86 CPU. The backend itself keeps AMX CPUs off the extra buffers (llama_devices)."""
    import llama_cpp

    from localinfer.backends.llama import devices as llama_devices
    from localinfer.gguf.header import read_header
    api = llama_devices._registry()
    cpu = api.by_type(0)
    listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(
        api.reg_proc(api.reg(cpu), b"ggml_backend_dev_get_extra_bufts"))(cpu)
    bufts = {}
    while listed[len(bufts)]:
        bufts[llama_devices._text(api.buft_name(listed[len(bufts)]))] = listed[len(bufts)]
    if "CPU_REPACK" not in bufts:
        raise SystemExit("error: this llama.cpp build has no CPU_REPACK buffer type")
    names = [t.name for t in read_header(path).tensors
             if t.type_name in REPACKED_TYPES and len(t.shape) == 2 and t.name != "token_embd.weight"]
    patterns = [("^" + n.replace(".", "\\.") + "$").encode() for n in names]
    overrides = (_Override * (len(names) + 1))(*[(p, bufts["CPU_REPACK"]) for p in patterns])
    default = llama_cpp.llama_model_default_params

    def with_overrides():
        params = default()
        params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return params
    llama_cpp.llama_model_default_params = with_overrides
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = default


def teacher_forced(session, tokens: list[int]) -> np.ndarray:
    """Logits of every position from an empty cache, in pieces of PIECE tokens as `eval` drives
    a session (int8 activations round per call, so the shape of the calls matters a little)."""
    session.reset()
    rows = [session.eval(tokens[i:i + PIECE], logits="all").copy()
            for i in range(0, len(tokens), PIECE)]
    return np.concatenate(rows)


def against(exact: np.ndarray, ours: np.ndarray) -> dict:
    """Top-1 agreement and KL(float64 || ours), reduced PIECE rows at a time."""
    divergence = np.concatenate([kl(exact[i:i + PIECE], ours[i:i + PIECE])
                                 for i in range(0, len(exact), PIECE)])
    order = np.argsort(exact, axis=-1)[:, ::-1][:, :5]
    rows = np.arange(len(exact))[:, None]
    err = (ours[rows, order[:, :1]] - ours[rows, order[:, 1:]]) - \
        (exact[rows, order[:, :1]] - exact[rows, order[:, 1:]])
    return {"top1": float((exact.argmax(-1) == ours.argmax(-1)).mean()),
            "mean_kl": float(divergence.mean()), "max_kl": float(divergence.max()),
            "pair_p999": float(np.quantile(np.abs(err), 0.999))}


def agreement(path: Path, n_tokens: int) -> dict[str, dict]:
    """Each engine's figures against the float64 forward on the first n_tokens of the text."""
    first = open_session(path, "llama.cpp", n_tokens)
    tokens = quality.tokens_for(first, quality.default_text())[:n_tokens]
    first.close()
    started = time.perf_counter()
    exact = Float64Model(path).logits(tokens)
    note(f"  float64 forward of {len(tokens)} tokens: {time.perf_counter() - started:.0f} s")
    figures = {}
    for engine in ENGINES:
        session = open_session(path, engine, n_tokens)
        figures[engine] = against(exact, teacher_forced(session, tokens)) | {"tokens": len(tokens)}
        session.close()
        note(f"  {engine}: {figures[engine]}")
    return figures


def perplexity(model: str, backend: str, args) -> float:
    """`localinfer eval` in a child process, as a user runs it."""
    cmd = [sys.executable, "-m", "localinfer", "eval", model, "--backend", backend, "--offline",
           "--ctx", str(args.ctx), "--chunks", str(args.chunks), "--threads", str(args.threads),
           "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])}: {done.stderr.strip()[-500:]}")
    record = json.loads(done.stdout)
    note(f"  eval --backend {backend}: perplexity {record['perplexity']:.4f} on "
         f"{record['tokens_scored']} tokens in {record['seconds']:.0f} s")
    return record["perplexity"]


def measure(model: str, args) -> dict:
    note(f"{model}:")
    path = common.model_file(model)
    figures = agreement(path, args.tokens)
    ppl = {b: perplexity(model, b, args) for b in ("llama.cpp", "onnx")}
    figures["onnx a4"]["ppl"], figures["llama.cpp"]["ppl"] = ppl["onnx"], ppl["llama.cpp"]
    return {"model": model, "file": path.name, "engines": figures,
            "ppl_rel": ppl["onnx"] / ppl["llama.cpp"] - 1}


def cpu_model() -> str:
    """The model name and the int8 instruction sets: both engines' rounding, and so the figures
    against each other, depend on which kernels the CPU gets (a VM often names no model)."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX2'})"


def table(results: list[dict], args) -> str:
    """One markdown table: a row per (model, engine); perplexity on the two `eval` rows."""
    command = shlex.join(["python", "scripts/onnx_quality.py", *sys.argv[1:]])
    chunks = args.chunks or "all"
    lines = [f"{datetime.date.today()}, {cpu_model()}, CPU provider: `{command}` (float64 "
             f"reference on {args.tokens} tokens; eval --ctx {args.ctx}, {chunks} chunks)",
             "",
             "| model | engine | top-1 vs float64 | mean KL | max KL | top-2..5 error p99.9 | "
             "eval perplexity | vs llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for engine, f in r["engines"].items():
            ppl = f"{f['ppl']:.4f}" if "ppl" in f else "-"
            rel = f"{r['ppl_rel']:+.2%}" if engine == "onnx a4" else "-"
            lines.append(f"| {r['model']} | {engine} | {f['top1']:.2%} | {f['mean_kl']:.2e} | "
                         f"{f['max_kl']:.2e} | {f['pair_p999']:.3f} | {ppl} | {rel} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="catalogue names or .gguf paths, already pulled")
    ap.add_argument("--tokens", type=int, default=512, help="teacher-forced tokens (default 512)")
    ap.add_argument("--ctx", type=int, default=512, help="eval chunk length (default 512)")
    ap.add_argument("--chunks", type=int, default=4, help="eval chunks; 0 = the whole text")
    # 1 is faster on a busy machine (llama.cpp's threads spin); the perplexity does not change.
    ap.add_argument("-t", "--threads", type=int, default=0, help="eval threads; 0 = physical cores")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead")
    args = ap.parse_args()
    results = [measure(m, args) for m in args.models]
    print(json.dumps(results, indent=2) if args.json else table(results, args))


if __name__ == "__main__":
    main()
