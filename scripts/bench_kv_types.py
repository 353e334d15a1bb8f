"""KV-cache types against exactness, quality and speed: the tables in docs/speculative-decoding.md.

    python scripts/bench_kv_types.py MODEL.gguf exact|quality|speed [ROUNDS]

Each configuration is (K type, V type) with flash attention on, as llama.cpp's CPU kernels see it:
- exact: max |Δlogit| between 8 single decode steps and the same 8 tokens in batches of k, after
  prefixes of 40 … 3,000 tokens of the bundled `eval` text;
- quality: KL divergence and top-1 agreement of 48 teacher-forced single steps at position 600
  against an f32 KV cache without flash attention (the highest-precision path llama.cpp has);
- speed: prefill of 512 tokens and decode steps near positions 100 and 2,000, configurations
  interleaved in one process, medians of per-round ratios to llama.cpp's default (f16, f16).
"""

from __future__ import annotations

import argparse
import time
from importlib import resources
from pathlib import Path

import common  # scripts/common.py
import numpy as np

from localinfer.backends import LoadOptions
from localinfer.backends.llama import session as llama_cpp

TYPES = {"f32": 0, "f16": 1, "bf16": 30}
CONFIGS = [("f16", "f16"), ("f16", "bf16"), ("bf16", "f16"), ("bf16", "bf16")]


class Session(llama_cpp.LlamaCppSession):
    """The backend's session with the K and V types (and flash attention) chosen here."""

    k, v, flash = "f16", "f16", True

    def _steered_context(self, options: LoadOptions, n_ctx: int):
        self._steer = None              # llama.cpp's kernels as each cache type gets them
        return self._new_context(options, n_ctx, steered=False)

    def _new_context(self, options: LoadOptions, n_ctx: int, *, steered: bool):
        lib = llama_cpp.engine()
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, options.n_batch, options.n_batch
        params.n_outputs_max = llama_cpp.MAX_OUTPUTS
        self.n_threads = llama_cpp.default_threads()
        params.n_threads = params.n_threads_batch = self.n_threads
        params.swa_full = True
        self._kv_types = params.type_k, params.type_v = TYPES[self.k], TYPES[self.v]
        params.flash_attn_type = 1 if self.flash else 0
        return lib.llama_init_from_model(self._model, params)


def load(path: Path, k: str, v: str, flash: bool = True) -> Session:
    Session.k, Session.v, Session.flash = k, v, flash
    return Session(path, LoadOptions(n_ctx=4096))


def tokens(session) -> list[int]:
    text = resources.files("localinfer").joinpath("data", "alice_ch1-3.txt").read_text("utf-8")
    return session.tokenize(text, special=False)


def exact(path: Path) -> None:
    for k, v in CONFIGS:
        s = load(path, k, v)
        toks = tokens(s)
        for prefix in (40, 200, 300, 600, 1500, 3000):
            s.reset()
            s.eval(toks[:prefix])
            rest = toks[prefix:prefix + 8]
            ref = np.stack([s.eval([t]).copy() for t in rest])
            deltas = {}
            for size in (2, 3, 4, 8):
                s.trim(prefix)
                rows = np.concatenate([s.eval(rest[i:i + size], logits="all").copy()
                                       for i in range(0, 8, size)])
                deltas[size] = round(float(np.abs(rows - ref).max()), 3)
            print(f"K {k} V {v} prefix {prefix}: max|Δ| by batch size {deltas}", flush=True)
        s.close()


def quality(path: Path, start: int = 600, n: int = 48) -> None:
    def steps(session) -> np.ndarray:
        toks = tokens(session)
        session.eval(toks[:start])
        out = np.stack([session.eval([t]).copy() for t in toks[start:start + n]])
        session.close()
        x = out.astype(np.float64)
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    ref = steps(load(path, "f32", "f32", flash=False))
    for k, v in CONFIGS:
        lp = steps(load(path, k, v))
        kl = (np.exp(ref) * (ref - lp)).sum(-1)
        top1 = (ref.argmax(-1) == lp.argmax(-1)).mean()
        print(f"K {k} V {v}: KL mean {kl.mean():.2e} max {kl.max():.2e} top-1 {top1:.3f}")


def speed(path: Path, rounds: int) -> None:
    configs = CONFIGS[:3]
    sessions = [load(path, k, v) for k, v in configs]
    toks = tokens(sessions[0])
    results = {c: {"pp512": [], "tg@100": [], "tg@2000": []} for c in configs}
    for r in range(rounds):
        order = list(zip(configs, sessions))
        for c, s in (order if r % 2 == 0 else order[::-1]):
            s.reset()
            s.eval(toks[:64])
            t = time.perf_counter()
            s.eval(toks[64:576])
            results[c]["pp512"].append(512 / (time.perf_counter() - t))
            s.trim(100)
            results[c]["tg@100"].append(_steps(s, toks[100:132]))
            s.trim(576)
            s.eval(toks[576:2000])
            results[c]["tg@2000"].append(_steps(s, toks[2000:2032]))
    base = results[configs[0]]
    for c in configs:
        cells = {key: f"{np.median(vals):.1f} t/s ({np.median(np.array(vals) / base[key]):.3f}x)"
                 for key, vals in results[c].items()}
        print(f"K {c[0]} V {c[1]}: {cells}", flush=True)


def _steps(session, toks: list[int]) -> float:
    t = time.perf_counter()
    for token in toks:
        session.eval([token])
    return len(toks) / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=common.gguf_file, help="a GGUF file")
    parser.add_argument("mode", choices=("exact", "quality", "speed"))
    parser.add_argument("rounds", type=int, nargs="?", default=4, help="speed only (default 4)")
    args = parser.parse_args()
    if args.mode == "exact":
        exact(args.model)
    elif args.mode == "quality":
        quality(args.model)
    else:
        speed(args.model, args.rounds)


if __name__ == "__main__":
    main()
