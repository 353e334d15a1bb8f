"""How well embeddings tell a paraphrase from a near miss, for `--reuse-similarity` (issue 45).

Each pair of tests/data/semantic_pairs.jsonl is labelled `same` (a paraphrase that deserves the
same answer) or not (a near miss that must not share one), with its kind. Both sides are
normalised as `--reuse-answers` normalises a prompt and embedded one at a time through the
product's own embedding path (pipeline/embed.py, what `localinfer embed` and the answer store
use), and their cosine similarity is compared with thresholds across the range: the hit rate on
paraphrases, the false hits on near misses (per kind too), and the lowest threshold with no
false hit at all, with its hit rate.

    python scripts/eval_semantic_reuse.py smollm2 gemma-3-270m /tmp/minilm.gguf [--json out.json]

Models are named as `localinfer embed` names them (catalogue names resolve in LOCALINFER_HOME's
store, offline); scripts/bert_to_gguf.py makes the all-MiniLM-L6-v2 GGUF from its package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PAIRS = ROOT / "tests" / "data" / "semantic_pairs.jsonl"
SHOWN = (0.50, 0.60, 0.70, 0.80, 0.85, 0.90, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995)
STEP = 0.001            # the grid the zero-false-hit threshold is found on


def load_pairs(path: Path = PAIRS) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    for row in rows:
        assert set(row) == {"a", "b", "same", "kind"}, row
    return rows


def similarities(model: str, rows: list[dict]) -> tuple[np.ndarray, dict]:
    """The cosine of each pair's two sides under `model`'s embeddings, and what was run."""
    from localinfer.cache.answers import normalise
    from localinfer.pipeline import embed
    texts = sorted({normalise(t) for row in rows for t in (row["a"], row["b"])})
    start = time.perf_counter()
    with embed.load(model, batch=1, offline=True) as embedder:
        # One text per call, as the answer store embeds a request: the batch's shape moves a
        # vector slightly (pipeline/embed.py), and the store never batches.
        vectors = {t: embed.vectors(embedder, t)[0] for t in texts}
        about = {"model": embedder.path.name, "dimensions": embedder.dimensions,
                 "pooling": embedder.pooling}
    about["seconds"] = round(time.perf_counter() - start, 2)
    cos = np.array([float(vectors[normalise(r["a"])] @ vectors[normalise(r["b"])])
                    for r in rows])
    return cos, about


def report(cos: np.ndarray, rows: list[dict]) -> dict:
    """Hit rates and false hits at the SHOWN thresholds, per kind, and the zero-false threshold."""
    same = np.array([r["same"] for r in rows])
    kinds: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        kinds[r["kind"]].append(i)

    def at(t: float) -> dict:
        hit = cos >= t
        return {"threshold": t, "hits": int(hit[same].sum()), "false_hits": int(hit[~same].sum()),
                "per_kind": {k: int(hit[ix].sum()) for k, ix in kinds.items()}}
    misses = cos[~same]
    # the lowest grid threshold above every near miss: nothing at or over it is a false hit
    zero = min(1.0, np.ceil((misses.max() + 1e-9) / STEP) * STEP)
    spread = {k: [round(float(np.min(cos[ix])), 4), round(float(np.median(cos[ix])), 4),
                  round(float(np.max(cos[ix])), 4)] for k, ix in kinds.items()}
    worst = sorted(np.flatnonzero(~same), key=lambda i: -cos[i])[:5]
    return {"paraphrases": int(same.sum()), "near_misses": int((~same).sum()),
            "kinds": {k: len(ix) for k, ix in kinds.items()},
            "rows": [at(t) for t in SHOWN], "zero_false": at(round(float(zero), 3)),
            "spread": spread,
            "worst_near_misses": [[rows[i]["a"], rows[i]["b"], round(float(cos[i]), 4)]
                                  for i in worst]}


def markdown(name: str, about: dict, result: dict, rows: list[dict]) -> str:
    same_kinds = [k for k in result["kinds"] if any(r["same"] and r["kind"] == k for r in rows)]
    miss_kinds = [k for k in result["kinds"] if k not in same_kinds]
    n_same, n_miss = result["paraphrases"], result["near_misses"]
    head = (f"**{name}** ({about['model']}, {about['dimensions']} dimensions, {about['pooling']} "
            f"pooling; {about['seconds']} s)\n\n")
    cols = ["threshold", "paraphrases hit", "near misses hit (false)"] + \
        [f"{k} ({result['kinds'][k]})" for k in miss_kinds]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in [*result["rows"], result["zero_false"]]:
        mark = " (lowest with no false hit)" if row is result["zero_false"] else ""
        cells = [f"{row['threshold']:g}{mark}",
                 f"{row['hits']}/{n_same} ({100 * row['hits'] / n_same:.0f}%)",
                 f"{row['false_hits']}/{n_miss} ({100 * row['false_hits'] / n_miss:.0f}%)"]
        cells += [str(row["per_kind"][k]) for k in miss_kinds]
        lines.append("| " + " | ".join(cells) + " |")
    zero = result["zero_false"]
    kinds = ", ".join(f"{k} {zero['per_kind'][k]}/{result['kinds'][k]}" for k in same_kinds)
    spread = "; ".join(f"{k} {lo:.3f}/{mid:.3f}/{hi:.3f}"
                       for k, (lo, mid, hi) in result["spread"].items())
    worst = "; ".join(f"\"{a}\" / \"{b}\" {c:.4f}" for a, b, c in result["worst_near_misses"][:3])
    return (head + "\n".join(lines) + f"\n\nAt {zero['threshold']:g}, paraphrases hit by kind: "
            f"{kinds}.\nCosine min/median/max by kind: {spread}.\nClosest near misses: {worst}.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="embedding models, as `localinfer embed` "
                        "names them")
    parser.add_argument("--pairs", type=Path, default=PAIRS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rows = load_pairs(args.pairs)
    out = {}
    for model in args.models:
        cos, about = similarities(model, rows)
        result = report(cos, rows)
        out[model] = {"about": about, **result, "cosines": [round(float(c), 5) for c in cos]}
        print(markdown(model, about, result, rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    print(f"{len(rows)} pairs from {args.pairs}", file=sys.stderr)


if __name__ == "__main__":
    main()
