#!/usr/bin/env python3
"""Op coverage without an NPU: the static graphs on OpenVINO's CPU device, CPU fallback disabled.

Per model, the CPU provider runs our prefill (T=--prefill) and decode (T=1) graphs teacher-forced
(one prefill call, then decode steps up to --tokens), keeping all logits and each call's inputs but
the cache; in a venv of its own (made once: onnxruntime-openvino replaces onnxruntime),
scripts/openvino_runner.py replays the calls on OpenVINOExecutionProvider with
`session.disable_cpu_ep_fallback`; the table compares the logits. A real model runs through
OnnxSession (form "static") on the bundled text. --tiny instead builds the tiny GGUFs of
tests/onnx_tiny.py in the configs of tests/test_onnx_graphs.py (MODELS, TOKENS: both imported from
tests/ on sys.path) and opens their exports, level 0, with the backend's own _runner: 24 positions,
T=8, 64 rows. They reach corners the real models do not (a uint8 BitShift, an unread input), so
they must match exactly: top-1 100%, max |diff| <= 1e-3.

Usage:

    python scripts/openvino_check.py smollm2 gemma-3-270m [--ctx 512] [--tokens 200]
    python scripts/openvino_check.py --tiny [CONFIG...]   # default: every config
    python scripts/openvino_check.py --probe GRAPH.onnx   # any graph: the ops OpenVINO leaves out

Exit status: 0 all good; 1 a session needs CPU fallback (ORT's line and the ops left to the CPU
are printed: the finding), top-1 < --min-top1 or max |diff| > --max-diff; 3 no venv can be made.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common  # scripts/common.py
import llama_tools  # scripts/llama_tools.py: the cache and its venvs
from openvino_runner import recording, save_calls   # the calls' format: both sides there

VENV = "openvino-venv"                          # in the scripts' cache (llama_tools.cache_root())
PACKAGE = "onnxruntime-openvino==1.24.1"      # the newest on the index when written; has OpenVINO
RUNNER = Path(__file__).resolve().parent / "openvino_runner.py"


def ensure_venv(package: str) -> Path:
    """The venv's python (scripts/llama_tools.py makes it when it lacks a working OpenVINO
    provider); exit 3 with one line when it cannot be made."""
    ready = ("import onnxruntime as o, numpy; "
             "assert 'OpenVINOExecutionProvider' in o.get_available_providers()")
    try:
        return llama_tools.ensure_venv(VENV, [package, "numpy"], ready)
    except llama_tools.BenchError as e:
        print(f"error: cannot make the OpenVINO venv: {e}", file=sys.stderr)
        sys.exit(3)


def teacher_forced(run, tokens: list[int], prefill: int) -> tuple[np.ndarray, float]:
    """All logits of one full prefill call, then one decode call per token (what save_calls
    assumes), and decode ms/token. run(chunk, n_past) evaluates chunk at positions n_past..."""
    rows = [run(tokens[:prefill], 0).copy()]
    started = time.perf_counter()
    rows += [run([t], i).copy() for i, t in enumerate(tokens[prefill:], prefill)]
    decode_ms = 1000 * (time.perf_counter() - started) / max(1, len(tokens) - prefill)
    return np.concatenate(rows), decode_ms


def onnx_options(args):
    from localinfer.backends import LoadOptions
    from localinfer.backends.onnx.session import OnnxOptions
    return (LoadOptions(n_ctx=args.ctx, n_threads=args.threads),
            OnnxOptions(accuracy=args.accuracy, form="static", prefill_tokens=args.prefill))


def cpu_run(model: str, args, work: Path) -> tuple[np.ndarray, float]:
    """A real model: OnnxSession's static graphs, the bundled text."""
    from localinfer.backends.onnx.session import OnnxSession
    from localinfer.measure import quality
    s = OnnxSession(common.model_file(model), *onnx_options(args))
    tokens = quality.tokens_for(s, quality.default_text())[:args.tokens]
    return teacher_forced(lambda chunk, _: s.eval(chunk, logits="all"), tokens, args.prefill)


def tiny_configs() -> tuple[dict, list[int]]:
    """test_onnx_graphs' MODELS {name: (arch, block types)} and TOKENS, imported from tests/."""
    common.use_tests()
    from test_onnx_graphs import MODELS, TOKENS
    return MODELS, TOKENS


def tiny_run(name: str, args, work: Path) -> tuple[np.ndarray, float]:
    """A tiny config: its GGUF and export in work/, the StaticRunner OnnxSession would make."""
    from onnx_tiny import write_tiny

    from localinfer.backends.onnx import arch as onnx_arch, export as onnx_export
    from localinfer.backends.onnx.session import _runner
    from localinfer.gguf.header import read_header
    models, tokens = tiny_configs()
    path = write_tiny(work / f"{name}.gguf", *models[name])
    header = read_header(path)
    spec = onnx_arch.read_spec(path, header)
    folder, index = onnx_export.ensure_weights(path, header, spec, work / "onnx")
    runner, _ = _runner(folder, index, spec, args.ctx, *onnx_options(args))
    return teacher_forced(lambda chunk, n_past: runner.run(chunk, n_past, 0), tokens[:args.tokens],
                          args.prefill)


def runner(python: Path, args, *first: str) -> subprocess.CompletedProcess:
    cmd = [str(python), str(RUNNER), *first, "--threads", str(args.threads)]
    return subprocess.run(cmd + [f"--option={o}" for o in args.option], capture_output=True,
                          text=True)


def ov_run(python: Path, work: Path, args) -> dict:
    done = runner(python, args, str(work))
    if done.returncode == 3:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0:
        return {"error": f"runner failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"}
    return json.loads((work / "ov.json").read_text())


def cpu_ops(python: Path, graph: str, args) -> collections.Counter:
    """Op types of the nodes ORT places on the CPU provider when OpenVINO may fall back."""
    log = runner(python, args, "--placement", graph).stderr
    ops, on_cpu = collections.Counter(), False
    for line in log.splitlines():
        if "placed on [" in line:
            on_cpu = "placed on [CPUExecutionProvider]" in line
        elif on_cpu and (m := re.search(r"VerifyEachNodeIsAssignedToAnEp\]\s+(\S+) \(", line)):
            ops[m.group(1)] += 1
    return ops


def compare(cpu: np.ndarray, ov: np.ndarray) -> tuple[float, float, float]:
    """Top-1 agreement, mean KL(CPU || OpenVINO) and max |diff| of the logits, 64 rows at a time
    (262k vocabularies)."""
    from localinfer.measure.quality import kl_rows, log_softmax
    same, kl, diff = 0, 0.0, []
    for i in range(0, len(cpu), 64):
        p, q = log_softmax(cpu[i:i + 64]), log_softmax(ov[i:i + 64])
        same += int((p.argmax(1) == q.argmax(1)).sum())
        kl += float(kl_rows(p, q).sum())
        diff.append(np.abs(cpu[i:i + 64] - ov[i:i + 64]).max())
    return same / len(cpu), kl / len(cpu), float(np.max(diff))     # NaN stays NaN: a failure


def check(model: str, record, python: Path, args) -> dict:
    """record(model, args, work): the CPU provider's logits and decode ms; its calls replayed."""
    with tempfile.TemporaryDirectory(prefix="openvino-check-") as tmp:
        work, calls = Path(tmp), []
        print(f"{model}: CPU provider, then OpenVINO", file=sys.stderr, flush=True)
        with recording(calls):
            cpu, cpu_ms = record(model, args, work)
        save_calls(calls, work)
        ov = ov_run(python, work, args)
        row = {"model": model, "positions": len(cpu), "cpu_decode_ms": cpu_ms, **ov}
        if "graph" in ov:              # a session failed: which ops OpenVINO left to the CPU
            return row | {"cpu_ops": dict(cpu_ops(python, ov["graph"], args))}
        if "error" in ov:
            return row
        row["top1"], row["kl"], row["max_diff"] = compare(cpu, np.load(work / "ov_logits.npy"))
        return row


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return (re.findall(r"^model name\s*:\s*(.+)$", info, re.M) or [os.uname().machine])[0]


def table(rows: list[dict], args) -> str:
    version = next((r["version"] for r in rows if "version" in r), "?")
    out = [f"OpenVINO EP check, {datetime.date.today()}, {cpu_name()} ({os.cpu_count()} CPUs), "
           f"onnxruntime-openvino {version}, options {' '.join(args.option)}, {args.threads} "
           f"threads, ctx {args.ctx}, accuracy level {args.accuracy}, prefill T={args.prefill} "
           f"then T=1", f"`{shlex.join(['python', *sys.argv])}`", "",
           f"| {'tiny config' if args.tiny else 'model'} | positions | top-1 vs CPU EP | mean KL | "
           "max abs diff | OV decode ms | CPU EP decode ms | OV compile s |", "|---" * 8 + "|"]
    for r in rows:
        head, cpu = f"| {r['model']} | {r['positions']} |", f"{r['cpu_decode_ms']:.1f}"
        if "error" in r:           # the finding: ORT's line and the ops OpenVINO did not take
            out.append(f"{head} session FAILED: {r['error']} ops on the CPU EP: "
                       f"{r.get('cpu_ops', '?')} | | | | {cpu} | |")
        else:
            out.append(f"{head} {r['top1']:.1%} | {r['kl']:.2e} | {r['max_diff']:.1e} | "
                       f"{r['decode_ms']:.1f} | {cpu} | {r['compile_s']:.1f} |")
    return "\n".join(out)


DEFAULTS = {False: dict(ctx=512, prefill=64, tokens=200, accuracy=4, min_top1=0.95,
                       max_diff=float("inf")),
            True: dict(ctx=64, prefill=8, tokens=24, accuracy=0, min_top1=1.0, max_diff=1e-3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="A / B in a help: the default for models / for --tiny.")
    ap.add_argument("models", nargs="*", help="default smollm2 gemma-3-270m / every tiny config")
    ap.add_argument("--tiny", action="store_true", help="the tiny GGUF configs, not real models")
    ap.add_argument("--ctx", type=int, help="cache rows (512 / 64)")
    ap.add_argument("--prefill", type=int, help="prefill tokens: one T-token call (64 / 8)")
    ap.add_argument("--tokens", type=int, help="positions compared in all (200 / 24)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--accuracy", type=int, choices=range(5),
                    help="MatMulNBits accuracy_level of the graphs (4 / 0: exact float32)")
    ap.add_argument("--option", action="append", metavar="KEY=VALUE",
                    help="OpenVINO provider option (repeatable; default precision=ACCURACY)")
    ap.add_argument("--min-top1", type=float, help="(0.95 / 1.0)")
    ap.add_argument("--max-diff", type=float, help="max |logit diff| (none / 1e-3)")
    ap.add_argument("--probe", metavar="GRAPH", help="only list the ops of GRAPH OpenVINO lacks")
    args = ap.parse_args()
    for key, value in DEFAULTS[args.tiny].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    # OpenVINO's CPU default (measured equal to precision=FP32) rounds activations too: against
    # level-4 graphs two roundings add up (smollm2 94.5% top-1). ACCURACY measures the graph, not
    # OV's precision choice: with --accuracy 0 both models then match the CPU EP exactly (KL 1e-8).
    args.option = args.option or ["precision=ACCURACY"]
    if args.tokens <= args.prefill:
        ap.error("--tokens must exceed --prefill: the decode steps are what is checked")
    tiny = sorted(tiny_configs()[0]) if args.tiny else []
    models = args.models or tiny or ["smollm2", "gemma-3-270m"]
    if args.tiny and (unknown := set(models) - set(tiny)):
        ap.error(f"no tiny config {', '.join(sorted(unknown))}; there are {', '.join(tiny)}")
    python = ensure_venv(PACKAGE)
    if args.probe:
        ops = cpu_ops(python, args.probe, args)
        print(f"{args.probe}: " + (f"the CPU EP takes {dict(ops)}" if ops else "all on OpenVINO"))
        sys.exit(1 if ops else 0)
    rows = [check(m, tiny_run if args.tiny else cpu_run, python, args) for m in models]
    print(table(rows, args))
    good = [r["top1"] >= args.min_top1 and r["max_diff"] <= args.max_diff   # False on NaN
            for r in rows if "error" not in r]
    sys.exit(0 if len(good) == len(rows) and all(good) else 1)


if __name__ == "__main__":
    main()
