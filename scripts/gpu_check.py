#!/usr/bin/env python3
"""Check localinfer's GPU offload against llama.cpp's own, on a machine with a GPU.

    python scripts/gpu_check.py MODEL.gguf [MODEL.gguf ...] [-r 5] [--rounds 3] [--json]

For every GGUF model, with every layer on the GPU (`-ngl 99`, `--gpu-layers 99`):

1. speed: `localinfer bench` against `llama-bench -fa 1`, built from the vendored llama.cpp of the
   installed llama-cpp-python with the GPU backend the installed engine has (CUDA, ROCm, Metal or
   Vulkan), in alternating rounds (the code of scripts/bench_vs_llama_bench.py, imported);
2. output: greedy `localinfer run --raw --temp 0` on the GPU against the same on the CPU
   (`--gpu-layers 0`); GPU kernels round differently, so a late divergence is reported, not failed;
3. a mixture of experts (qwen3moe, gpt-oss, ...): greedy output with the experts of half its layers
   kept in RAM (`--cpu-moe N`, tensor buffer-type overrides) against all of it on the GPU,
   reported like the CPU comparison (the experts' kernels run on the CPU then);
4. memory: the fit's estimate of what the GPU holds (`Placement.on_gpu`) against the device memory
   the engine reports in use after the load (free memory from ggml's registry before the model is
   loaded minus after its context is made), in a fresh process so nothing else holds memory there;
5. with `--multimodal [MODEL]` (a catalogue vision model, smolvlm2-256m-video-instruct by default):
   images on the GPU, `localinfer run --image` against llama-mtmd-cli, the same greedy tokens and
   time to first token side by side (scripts/multimodal_check.py, which runs alone on a Mac); a
   model that cannot be fetched is a `skip:` line, not a failure.

Prints one table (or JSON). Exit 0 when every model decodes at 0.95x llama-bench or better and its
estimate is within 10% of what the device holds; 1 when one does not (the failures on stderr);
2 when it cannot check here: no GPU in the engine (with the command that rebuilds it), or a
missing model. Nothing here is CUDA-specific: it runs unchanged wherever the engine has a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_llama_bench as lb  # noqa: E402  (the llama-bench build and the alternating runs)
import multimodal_check as mm  # noqa: E402  (--multimodal: images against llama-mtmd-cli)

ALL_LAYERS = 99               # llama-bench's -ngl 99: every layer of any model below 99 layers
DECODE_FLOOR = 0.95           # localinfer's decode at least this share of llama-bench's
MEMORY_TOLERANCE = 0.10       # the estimate within this share of what the device holds
GREEDY_PROMPT = "The history of the printing press begins"
GREEDY_TOKENS = 64
EXIT_FAILED, EXIT_CANNOT_CHECK = 1, 2


class CannotCheck(lb.BenchError):
    """This machine cannot run the check (no GPU in the engine, no such model): exit 2."""


# --------------------------------------------------------------------------
# The probe: a fresh process that asks the engine (and loads one model)
# --------------------------------------------------------------------------


def probe(model: Path | None, n_ctx: int) -> dict:
    """The engine's GPUs; with a model, the fit's estimate of what they hold and what they hold
    after the load. Runs in its own process (`--probe`): the first registry call creates the
    GPU context, which then stays out of the figure, and no other model is loaded there."""
    from localinfer.backends import LoadOptions
    from localinfer.backends.llama import devices as llama_devices
    from localinfer.backends.llama.engine import init_engine
    from localinfer.backends.llama.session import LlamaCppSession
    from localinfer.fit import memory, rules
    init_engine(False)
    targets = llama_devices.offload_targets(llama_devices.devices())
    result: dict = {"gpus": [d.as_dict() for d in targets]}
    if model is None or not targets:
        return result
    machine = rules.detect_machine()
    placed = rules.place(memory.facts_from_file(model), machine, rules.budget(machine),
                         n_ctx=n_ctx, kv_type="f16", gpu_layers=ALL_LAYERS)
    before = _free(targets)
    session = LlamaCppSession(model, LoadOptions(n_ctx=placed.n_ctx, kv_type="f16",
                                                 gpu_layers=ALL_LAYERS))
    after = _free(targets)
    result.update(n_ctx=placed.n_ctx, estimate=placed.on_gpu, in_use=before - after,
                  offload=session.offload.as_dict())
    session.close()
    return result


def _free(targets) -> int:
    from localinfer.backends.llama import devices as llama_devices
    now = {d.name: d.memory_free for d in llama_devices.read_registry()}
    return sum(now[d.name] for d in targets)


def run_probe(model: Path | None, n_ctx: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--ctx", str(n_ctx)]
    data = lb.run_json(cmd + ([str(model)] if model else []),
                       f"memory probe{f' on {model.name}' if model else ''}", quiet=model is None)
    if not isinstance(data, dict):
        raise lb.BenchError("the probe printed no JSON object")
    return data


def gpu_backend(gpus: list[dict]) -> str:
    """The ggml backend of the engine's GPUs (CUDA, ROCm, MTL, Vulkan); CannotCheck without one."""
    from localinfer.fit import gpu
    if not gpus:
        hint = gpu.this_rebuild_hint([]) or ""
        raise CannotCheck("the installed llama.cpp has no GPU backend, so there is nothing to "
                          "check here" + (f"; {hint}" if hint else ""))
    backend = gpus[0]["backend"]
    if backend not in gpu.BUILDS:
        raise CannotCheck(f"no llama-bench build is known for the {backend} backend; "
                          f"known: {', '.join(gpu.BUILDS)}")
    return backend


# --------------------------------------------------------------------------
# The three comparisons
# --------------------------------------------------------------------------


def greedy_text(model: Path, gpu_layers: int, cpu_moe: int = 0) -> str:
    moe = ["--cpu-moe", str(cpu_moe)] if cpu_moe else []
    data = lb.run_json([sys.executable, "-m", "localinfer", "run", str(model), GREEDY_PROMPT,
                        "--raw", "--temp", "0", "-n", str(GREEDY_TOKENS), "--no-cache", "--draft",
                        "none", "--json", "--gpu-layers", str(gpu_layers), *moe],
                       f"greedy run on {model.name} with --gpu-layers {gpu_layers} {' '.join(moe)}")
    return data["text"]


def moe_layers(model: Path) -> int:
    """Layers whose experts the MoE case keeps in RAM: half of a mixture's; 0 for a dense model
    (or a file this check cannot read, which the other comparisons report)."""
    from localinfer.errors import LocalinferError
    from localinfer.fit import memory
    try:
        facts = memory.facts_from_file(model)
    except (LocalinferError, OSError):
        return 0
    return max(1, facts.n_layer // 2) if any(facts.expert_bytes) else 0


def same_text(gpu_text: str, cpu_text: str) -> str:
    """"identical", or where the GPU's greedy text leaves the CPU's."""
    if gpu_text == cpu_text:
        return "identical"
    at = next((i for i, (a, b) in enumerate(zip(gpu_text, cpu_text)) if a != b),
              min(len(gpu_text), len(cpu_text)))
    return f"differs at char {at} of {len(cpu_text)}"


def check_model(model: Path, llama_bench: Path, args: argparse.Namespace) -> dict:
    """One row: speed against llama-bench, greedy output against the CPU, memory against the
    estimate."""
    speed = lb.bench_model(model, llama_bench, args.threads, args.repetitions, args.rounds,
                           llama_bench_args=("-ngl", str(ALL_LAYERS), "-fa", "1"),
                           localinfer_args=("--gpu-layers", str(ALL_LAYERS)))
    tests = {row["test"]: row for row in speed}
    pp, tg = tests[lb.test_name(lb.N_PROMPT, 0)], tests[lb.test_name(0, lb.N_GEN)]
    memory = run_probe(model, args.ctx)
    on_gpu = greedy_text(model, ALL_LAYERS)
    row = build_row(model.name, pp, tg, memory, same_text(on_gpu, greedy_text(model, 0)))
    n_moe = moe_layers(model)
    if n_moe:
        row["cpu_moe"] = n_moe
        row["greedy_cpu_moe_vs_gpu"] = same_text(greedy_text(model, ALL_LAYERS, n_moe), on_gpu)
    return row


def build_row(name: str, pp: dict, tg: dict, memory: dict, greedy: str) -> dict:
    offload = memory.get("offload", {})
    estimate, in_use = memory.get("estimate", 0), memory.get("in_use", 0)
    return {
        "model": name,
        "pp_llama_bench": pp["llama_bench_tps"], "pp_localinfer": pp["localinfer_tps"],
        "pp_ratio": pp["paired_ratio"],
        "tg_llama_bench": tg["llama_bench_tps"], "tg_localinfer": tg["localinfer_tps"],
        "tg_ratio": tg["paired_ratio"],
        "gpu_layers": f"{offload.get('gpu_layers', '?')}/{offload.get('layers', '?')}",
        "greedy_vs_cpu": greedy, "n_ctx": memory.get("n_ctx"),
        "estimate": estimate, "in_use": in_use,
        "memory_ratio": in_use / estimate if estimate else None,
    }


def failures(row: dict) -> list[str]:
    """What makes the check fail for this row: decode below 0.95x llama-bench, or an estimate
    more than 10% from what the device holds."""
    found = []
    if row["tg_ratio"] < DECODE_FLOOR:
        found.append(f"{row['model']}: decode at {row['tg_ratio']:.3f}x llama-bench, below "
                     f"{DECODE_FLOOR}x")
    ratio = row["memory_ratio"]
    if ratio is None or abs(ratio - 1) > MEMORY_TOLERANCE:
        shown = "no estimate" if ratio is None else f"{ratio:.3f}x the estimate"
        found.append(f"{row['model']}: the GPU holds {row['in_use'] / 2**20:.0f} MiB after the "
                     f"load, {shown} ({row['estimate'] / 2**20:.0f} MiB), outside "
                     f"±{MEMORY_TOLERANCE:.0%}")
    return found


def format_table(header: str, rows: list[dict]) -> str:
    lines = [header, "",
             "| model | pp512 llama-bench | pp512 localinfer | ratio | tg128 llama-bench "
             "| tg128 localinfer | ratio | layers on GPU | greedy vs CPU | GPU memory estimate "
             "| in use after load | ratio | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for row in rows:
        ratio = row["memory_ratio"]
        verdict = "ok" if not failures(row) else "FAIL"
        lines.append(
            f"| {row['model']} | {row['pp_llama_bench']:.1f} | {row['pp_localinfer']:.1f} "
            f"| {row['pp_ratio']:.3f} | {row['tg_llama_bench']:.1f} | {row['tg_localinfer']:.1f} "
            f"| {row['tg_ratio']:.3f} | {row['gpu_layers']} | {_greedy_cell(row)} "
            f"| {row['estimate'] / 2**20:.0f} MiB | {row['in_use'] / 2**20:.0f} MiB "
            f"| {'n/a' if ratio is None else f'{ratio:.3f}'} | {verdict} |")
    return "\n".join(lines)


def _greedy_cell(row: dict) -> str:
    moe = (f"; experts of {row['cpu_moe']} layers in RAM vs all on GPU: "
           f"{row['greedy_cpu_moe_vs_gpu']}" if row.get("cpu_moe") else "")
    return row["greedy_vs_cpu"] + moe


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check localinfer's GPU offload against llama-bench -ngl 99: speed, greedy "
                    "output against the CPU, and the memory estimate against the device.")
    parser.add_argument("models", nargs="*", type=Path, help="GGUF model files")
    parser.add_argument("-t", "--threads", type=int, default=lb.physical_cores(),
                        help="CPU threads for both tools (default: physical cores)")
    parser.add_argument("-r", "--repetitions", type=int, default=lb.DEFAULT_REPETITIONS,
                        help=f"repetitions per test (default: {lb.DEFAULT_REPETITIONS})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the two tools this many times per model (default: 3)")
    parser.add_argument("--ctx", type=int, default=4096,
                        help="context of the memory check (default: 4096, run's default)")
    parser.add_argument("--llama-bench", type=Path,
                        help="a llama-bench built with the engine's GPU backend (default: build one)")
    parser.add_argument("--build-dir", type=Path,
                        help="llama.cpp download/build cache "
                             "(default: llama.cpp-VERSION in $LOCALINFER_BENCH_CACHE, else "
                             "~/.cache/localinfer-bench)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel build jobs (default: CPU count)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--multimodal", nargs="?", const=mm.DEFAULT_MODEL, metavar="MODEL",
                        help="also check images on the GPU against llama-mtmd-cli with this "
                             f"catalogue vision model (default: {mm.DEFAULT_MODEL})")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.models and not args.probe and not args.multimodal:
        parser.error("give at least one GGUF model")
    for name in ("threads", "repetitions", "rounds", "ctx", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def build_llama_bench(backend: str, args: argparse.Namespace) -> Path:
    """llama-bench from the installed llama-cpp-python's vendored llama.cpp, with `backend`."""
    from localinfer.fit import gpu
    if args.llama_bench:
        if not args.llama_bench.is_file():
            raise CannotCheck(f"llama-bench not found: {args.llama_bench}")
        return args.llama_bench
    version = lb.installed_llama_cpp_version()
    build_dir = (args.build_dir or lb.source_root(version)).expanduser()
    return lb.ensure_llama_bench(build_dir, version, args.jobs, (gpu.BUILDS[backend].cmake,),
                                 build_name=f"build-{backend.lower()}")


def run(args: argparse.Namespace) -> int:
    # The GPU first: without one, nothing else here can be checked, whatever the models.
    engine = run_probe(None, args.ctx)
    backend = gpu_backend(engine["gpus"])
    for model in args.models:
        if not model.is_file():
            raise CannotCheck(f"model file not found: {model}")
    if not args.models:
        return multimodal(args)
    llama_bench = build_llama_bench(backend, args)
    rows = [check_model(model, llama_bench, args) for model in args.models]
    gpus = ", ".join(f"{g['name']} ({g['description']})" for g in engine["gpus"])
    header = (f"GPU: {gpus}; backend {backend}; llama-cpp-python "
              f"{lb.installed_llama_cpp_version()}; {args.threads} threads, {args.repetitions} "
              f"repetitions x {args.rounds} alternating rounds; memory at context {args.ctx}")
    if args.json:
        print(json.dumps({"header": header, "llama_bench": str(llama_bench), "rows": rows},
                         indent=2))
    else:
        print(format_table(header, rows))
    failed = [line for row in rows for line in failures(row)]
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    images = multimodal(args) if args.multimodal else 0
    return EXIT_FAILED if failed or images == EXIT_FAILED else 0


def multimodal(args: argparse.Namespace) -> int:
    """The images check (multimodal_check.py) with every layer on the GPU; a model that cannot
    be fetched is a skip line and no failure (0)."""
    try:
        return mm.check(args.multimodal, gpu_layers=ALL_LAYERS, rounds=args.rounds,
                        threads=args.threads, jobs=args.jobs)
    except mm.Skip as exc:
        print(f"skip: multimodal check: {exc}", file=sys.stderr)
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.probe:
            print(json.dumps(probe(args.models[0] if args.models else None, args.ctx)))
            return 0
        return run(args)
    except CannotCheck as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    except (lb.BenchError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
