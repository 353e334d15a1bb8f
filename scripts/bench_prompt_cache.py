"""Prompt-cache benchmark: time to first token cold vs warm (exact hit, shared-prefix hit), the cost
of saving an entry, and chat turn 10 vs turn 2. Cold and warm runs alternate; medians are reported.

    python scripts/bench_prompt_cache.py [--reps 3] [--tokens 2000] [--prefix 1500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import common  # scripts/common.py

from localinfer.backends import LoadOptions
from localinfer.backends.llama.session import LlamaCppSession
from localinfer.cache.prompt_cache import PromptCache
from localinfer.engine.batching import LAYOUT
from localinfer.engine.decode import Generation, Limits
from localinfer.engine.kv import KVCache
from localinfer.engine.prompt import chat_tokens, with_bos
from localinfer.engine.sampling import SamplingParams, make_sampler

MODELS = ("smollm2", "gemma-3-270m")   # catalogue names, pulled through localinfer's own store
# A fixed text (it ships with localinfer as `eval`'s default), so prompts do not change with the docs.
DOC = Path(__file__).resolve().parents[1] / "localinfer" / "data" / "alice_ch1-3.txt"
GREEDY = make_sampler(SamplingParams(temperature=0))


def model_path(name: str) -> Path:
    """The model's file in the store (LOCALINFER_HOME applies), pulled first when missing."""
    return common.model_file(name, offline=False, notify=print)


def generate(session, store, prompt, n_gen=16):
    cache = KVCache(session, store)
    start = time.perf_counter()
    gen = Generation(cache, prompt, GREEDY, Limits(max_tokens=n_gen, ignore_eos=True))
    list(gen)
    total = time.perf_counter() - start
    t = time.perf_counter()
    cache.persist()
    return gen, total, time.perf_counter() - t


def prompts(session, n_tokens, n_prefix):
    doc = session.tokenize(DOC.read_text() * 4, special=False)   # past any --tokens a model takes
    a = with_bos(session, doc[:n_tokens - 12]) + session.tokenize(
        "\n\nQuestion: what is this document about? Answer:", special=False)
    b = with_bos(session, doc[:n_prefix]) + session.tokenize(
        "\n\nQuestion: which commands does it list? Answer:", special=False)
    return a, b


def bench_model(name, path, reps, n_tokens, n_prefix):
    session = LlamaCppSession(path, LoadOptions(n_ctx=4096))
    a, b = prompts(session, n_tokens, n_prefix)
    rows = {k: [] for k in ("cold", "cold_prefix", "warm_exact", "warm_prefix", "save_frac",
                            "save_s")}
    identical = True
    for rep in range(reps):
        with tempfile.TemporaryDirectory() as root:
            store = PromptCache(Path(root), {**session.state_identity(), "batching": LAYOUT},
                                label=path.name, cap_bytes=10 ** 10)
            cold, total, save_s = generate(session, store, a)
            exact, _, _ = generate(session, store, a)
            prefix, _, _ = generate(session, store, b)
            plain_b, _, _ = generate(session, None, b)
        identical &= cold.tokens == exact.tokens and prefix.tokens == plain_b.tokens
        rows["cold"].append(cold.stats.ttft_s)
        rows["warm_exact"].append(exact.stats.ttft_s)
        rows["warm_prefix"].append(prefix.stats.ttft_s)
        rows["cold_prefix"].append(plain_b.stats.ttft_s)   # the same prompt, no cache
        rows["save_s"].append(save_s)
        rows["save_frac"].append(save_s / (total + save_s))
        print(f"  {name} rep {rep}: cold {cold.stats.ttft_s:.2f}s exact {exact.stats.ttft_s:.3f}s "
              f"prefix {prefix.stats.ttft_s:.3f}s (restored {prefix.stats.cached_tokens}, "
              f"cold {plain_b.stats.ttft_s:.2f}s) "
              f"save {save_s:.3f}s of {total + save_s:.2f}s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    session.close()
    return {"model": name, "prompt_tokens": len(a), "prefix_prompt_tokens": len(b),
            "cold_ttft_s": med["cold"], "warm_exact_ttft_s": med["warm_exact"],
            "warm_prefix_ttft_s": med["warm_prefix"],
            "exact_speedup": med["cold"] / med["warm_exact"],
            "cold_prefix_ttft_s": med["cold_prefix"],
            "prefix_speedup": med["cold_prefix"] / med["warm_prefix"],
            "save_s": med["save_s"], "save_fraction": med["save_frac"], "identical": identical}


def bench_chat(path, turns=10, n_gen=16):
    session = LlamaCppSession(path, LoadOptions(n_ctx=4096))
    cache = KVCache(session)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    ttft = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tell me one fact about the number {turn + 7}."})
        gen = Generation(cache, chat_tokens(session, messages), GREEDY,
                         Limits(max_tokens=n_gen, ignore_eos=True))
        reply = "".join(gen)
        messages.append({"role": "assistant", "content": reply.strip()})
        ttft.append((gen.stats.ttft_s, gen.stats.prompt_tokens, gen.stats.cached_tokens))
    session.close()
    return ttft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--prefix", type=int, default=1500)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    paths = {name: model_path(name) for name in MODELS}
    results = [bench_model(n, p, args.reps, args.tokens, args.prefix) for n, p in paths.items()]
    chat = bench_chat(paths["smollm2"])
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    for i, (t, p, c) in enumerate(chat, 1):
        print(f"chat turn {i}: ttft {t * 1000:.0f} ms, prompt {p} tokens, {c} reused")
    print(f"chat turn 10 / turn 2 ttft: {chat[9][0] / chat[1][0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"models": results, "chat": chat}, indent=2))


if __name__ == "__main__":
    main()
