#!/usr/bin/env python3
"""Check the ONNX Runtime backend on a laptop's NPU (Snapdragon X, Core Ultra, Ryzen AI).

    python scripts/npu_check.py MODEL [MODEL ...] [--tokens 128] [--gen 32] [--no-bench] [--json]

For every model (a catalogue name or a .gguf path):

1. lists ONNX Runtime's providers and devices (plugin providers registered, as localinfer does);
2. exports the model and compiles its static graphs on each NPU with CPU fallback disabled: the
   same check `auto` makes, so a model `auto` would not put on the NPU fails here too;
3. on the NPU that takes it: teacher-forced logits of the first --tokens tokens of the bundled
   text against the CPU provider (top-1 agreement, mean KL), a greedy `localinfer run --backend
   onnx` (which runs on that NPU), and `localinfer bench --backend onnx` beside `--backend
   llama.cpp`.

Prints one table (or JSON). Exit 0 when every model runs wholly on an NPU, 1 when one does not, 2
(one line saying why) when this machine has no NPU to check. Nothing in it names one vendor: what differs between laptops is the
provider package installed (the README says which). `--device cpu` runs every step with the CPU
provider standing in for the NPU (static graphs), to try the script on any machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import common  # scripts/common.py

GREEDY_PROMPT = "The history of the printing press begins"
EXIT_FAILED, EXIT_NO_NPU = 1, 2       # as scripts/gpu_check.py: 2 = cannot check here


def list_devices() -> list:
    from localinfer.backends.onnx import devices as onnx_devices
    problems = onnx_devices.register_plugins()
    for name, problem in problems.items():
        print(f"plugin {name}: {problem or 'registered'}", file=sys.stderr)
    found = onnx_devices.targets()
    for t in found:
        print(f"device {t.kind}: {t.label}", file=sys.stderr)
    return found


def no_npu_here() -> str | None:
    """Why this machine has no NPU to check (one line), or None when ONNX Runtime lists one."""
    from localinfer.backends.onnx import devices as onnx_devices, npu as onnx_npu
    try:
        if onnx_npu.npu_installed() and onnx_devices.npu_targets():
            return None
    except ImportError:
        return "onnxruntime is not installed: pip install 'localinfer[onnx]'"
    return (f"no NPU here: {onnx_npu.decide(None).reason}; install the provider package for "
            "this laptop's NPU (README: 'NPUs'), or pass --device cpu to try the script with "
            "the CPU provider")


def npu_for(path: Path, stand_in: bool):
    """(target, verdict text): the NPU that takes the whole graph, or None and why not."""
    from localinfer.backends.onnx import devices as onnx_devices, npu as onnx_npu
    if stand_in:
        return onnx_devices.CPU, "the CPU provider standing in (--device cpu)"
    decision = onnx_npu.decide(path)
    return decision.target, decision.reason


def compare_logits(path: Path, target, n_tokens: int) -> dict:
    """Top-1 agreement and mean KL of the device's logits against the CPU provider's."""
    from localinfer.backends import LoadOptions
    from localinfer.backends.onnx.session import OnnxOptions, OnnxSession
    from localinfer.engine.prompt import with_bos
    from localinfer.measure.quality import default_text
    options = LoadOptions(n_ctx=max(256, n_tokens))
    rows, load_s = {}, {}
    for side, onnx in (("device", OnnxOptions(target=target, form="static")),
                       ("cpu", OnnxOptions())):
        start = time.perf_counter()
        session = OnnxSession(path, options, onnx)
        load_s[side] = time.perf_counter() - start
        tokens = with_bos(session, session.tokenize(default_text(), special=False))[:n_tokens]
        rows[side] = session.eval(tokens, logits="all").astype(np.float64)
        session.close()
    dev, cpu = rows["device"], rows["cpu"]
    top1 = float(np.mean(dev.argmax(-1) == cpu.argmax(-1)))
    return {"top1_vs_cpu": round(top1, 4), "kl_vs_cpu": float(f"{_mean_kl(cpu, dev):.3g}"),
            "device_load_s": round(load_s["device"], 2)}


def _mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.mean((np.exp(lp) * (lp - lq)).sum(-1)))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localinfer", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)


def greedy(model: str, n: int) -> str:
    done = cli("run", model, GREEDY_PROMPT, "--backend", "onnx", "--raw", "--temp", "0",
               "-n", str(n))
    if done.returncode != 0:
        return f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return done.stdout.strip().replace("\n", " ")[:60]


def bench(model: str, backend: str) -> dict:
    done = cli("bench", model, "--backend", backend, "-p", "512", "-n", "128", "-r", "3", "--json")
    if done.returncode != 0:
        return {}
    result = json.loads(done.stdout)
    return {"pp": round(result["prefill_tps"]["median"], 1),
            "tg": round(result["decode_tps"]["median"], 1)}


def check_model(model: str, args) -> dict:
    path = common.model_file(model, offline=False, progress=True, notify=common.to_stderr)
    target, why = npu_for(path, args.device == "cpu")
    row = {"model": model, "npu": target.label if target else None, "whole_graph": target is not None,
           "why": why}
    if target is None:
        return row
    row |= compare_logits(path, target, args.tokens)
    row["greedy"] = greedy(model, args.gen)
    onnx, llama = ({}, {}) if args.no_bench else (bench(model, "onnx"), bench(model, "llama.cpp"))
    row |= {"onnx_pp": onnx.get("pp"), "onnx_tg": onnx.get("tg"),
            "llama_pp": llama.get("pp"), "llama_tg": llama.get("tg")}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | NPU | whole graph | top-1 vs CPU | KL vs CPU | onnx pp / tg t/s | "
             "llama.cpp pp / tg t/s | greedy |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["whole_graph"]:
            lines.append(f"| {r['model']} | none | no: {r['why']} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['npu']} | yes | {r['top1_vs_cpu']:.1%} | "
                     f"{r['kl_vs_cpu']:.2g} | {r['onnx_pp']} / {r['onnx_tg']} | "
                     f"{r['llama_pp']} / {r['llama_tg']} | {r['greedy']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=128, help="teacher-forced tokens compared")
    ap.add_argument("--gen", type=int, default=32, help="tokens of the greedy answer")
    ap.add_argument("--device", choices=("npu", "cpu"), default="npu",
                    help="cpu: the CPU provider stands in for the NPU, to try the script")
    ap.add_argument("--no-bench", action="store_true", help="skip the two benches")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    missing = no_npu_here() if args.device == "npu" else None
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_NO_NPU
    list_devices()
    rows = [check_model(m, args) for m in args.models]
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0 if all(r["whole_graph"] for r in rows) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
