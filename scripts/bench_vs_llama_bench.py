#!/usr/bin/env python3
"""Compare ``localinfer bench`` with llama.cpp's own ``llama-bench``.

Maintenance script (stdlib only). It answers one question: how much slower
or faster is localinfer than the llama.cpp it is built on, on this machine?

Steps:

1. Find the installed llama-cpp-python version, download its sdist with
   ``python -m pip download`` (so the user's pip configuration applies),
   extract ``vendor/llama.cpp`` and build the ``llama-bench`` target with
   cmake (scripts/llama_tools.py).  The result is cached in
   ``~/.cache/localinfer-bench/llama.cpp-VERSION`` (``LOCALINFER_BENCH_CACHE``
   moves it) and reused next time.
2. For every GGUF model given, run ``llama-bench -p 512 -n 128`` and
   ``localinfer bench`` back to back with the same threads and repetitions,
   alternating the two for several rounds so machine noise hits both sides.
   ``--prompts 128,450,2048`` measures prefill at each of those lengths
   (``localinfer bench -p N`` once per length: the path ``run`` takes for a
   prompt that long).
3. Print a markdown table (or JSON with ``--json``) of prompt processing
   (pp512, or each length asked) and generation (tg128) tokens/s and the
   localinfer/llama-bench ratio.  Both sides report the median of all their per-repetition samples
   (llama-bench's ``samples_ts``).

Usage:

    python scripts/bench_vs_llama_bench.py --build-only
    python scripts/bench_vs_llama_bench.py model-a.gguf model-b.gguf -t 4 -r 5

Build progress and benchmark progress go to stderr; results go to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tools import (CPU_BUILD, BenchError, ensure_tool,  # noqa: E402
                         installed_llama_cpp_version, log, source_root)

N_PROMPT = 512
N_GEN = 128
DEFAULT_REPETITIONS = 5


def ensure_llama_bench(build_dir: Path, version: str, jobs: int,
                       extra_options: tuple[str, ...] | None = None,
                       build_name: str = CPU_BUILD) -> Path:
    """The cached llama-bench of build_dir (scripts/llama_tools.py builds it if need be); a build
    with other cmake options (a GPU backend's) goes to its own `build_name` beside the CPU one."""
    return ensure_tool("llama-bench", jobs=jobs, extra_options=extra_options,
                       build_name=build_name, version=version, root=build_dir)


def build_name_for(options: tuple[str, ...] | None) -> str:
    """The wheel-feature build's folder, or one named by the options' hash (a build per set)."""
    if options is None:
        return CPU_BUILD
    import hashlib  # noqa: PLC0415
    return "build-" + hashlib.sha256(" ".join(options).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------
# Machine description
# --------------------------------------------------------------------------


def cpuinfo_entries() -> list[dict[str, str]]:
    """Parse /proc/cpuinfo into one dict per logical CPU (empty if absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    entries = []
    for block in text.strip().split("\n\n"):
        pairs = (line.split(":", 1) for line in block.splitlines() if ":" in line)
        entries.append({key.strip(): value.strip() for key, value in pairs})
    return entries


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo, or a platform fallback."""
    for entry in cpuinfo_entries():
        for key in ("model name", "Model", "cpu model", "Hardware"):
            if entry.get(key):
                return entry[key]
    return platform.processor() or platform.machine() or "unknown CPU"


def physical_cores() -> int:
    """Number of physical cores; os.cpu_count() when it cannot be told."""
    entries = cpuinfo_entries()
    cores = {(e.get("physical id"), e.get("core id")) for e in entries if "core id" in e}
    if cores:
        return len(cores)
    per_socket = [e["cpu cores"] for e in entries if e.get("cpu cores", "").isdigit()]
    if per_socket:
        sockets = {e.get("physical id") for e in entries}
        return int(per_socket[0]) * max(len(sockets), 1)
    return os.cpu_count() or 1


# --------------------------------------------------------------------------
# Running the two benchmarks
# --------------------------------------------------------------------------


def run_json(cmd: list[str], label: str, env: dict | None = None, quiet: bool = False) -> object:
    """Run cmd, return its stdout parsed as JSON; raise BenchError on failure. `quiet`: no
    progress line (a question asked before anything is measured)."""
    if not quiet:
        log(f"running {label}: " + " ".join(cmd))
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as exc:
        raise BenchError(f"{label} could not be started: {exc}") from None
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else "no output"
        raise BenchError(f"{label} failed (exit {result.returncode}): {detail}")
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError:
        raise BenchError(f"{label} printed no valid JSON on stdout") from None


def test_name(n_prompt: int, n_gen: int) -> str:
    """llama-bench's name for a test: pp512, tg128 or pp512+tg128."""
    if n_gen == 0:
        return f"pp{n_prompt}"
    if n_prompt == 0:
        return f"tg{n_gen}"
    return f"pp{n_prompt}+tg{n_gen}"


def parse_llama_bench(data: object) -> dict[str, list[float]]:
    """Map test name -> per-repetition tokens/s from llama-bench's ``-o json`` output.

    Uses ``samples_ts`` when present, otherwise llama-bench's mean ``avg_ts`` as one sample.
    """
    if not isinstance(data, list):
        raise BenchError("llama-bench JSON is not a list of test results")
    results = {}
    for test in data:
        name = test_name(int(test["n_prompt"]), int(test["n_gen"]))
        results[name] = [float(x) for x in test.get("samples_ts") or [test["avg_ts"]]]
    return results


def parse_localinfer(data: object) -> dict[str, list[float]]:
    """Map test name -> per-repetition tokens/s from ``localinfer bench --json``."""
    try:
        n_prompt, n_gen = int(data["n_prompt"]), int(data["n_gen"])
        return {
            test_name(n_prompt, 0): [float(v) for v in data["prefill_tps"]["values"]],
            test_name(0, n_gen): [float(v) for v in data["decode_tps"]["values"]],
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"unexpected localinfer bench JSON (missing {exc})") from None


def wheel_lib_env() -> dict:
    """Environment that makes llama-bench load the engine libraries of the installed wheel.

    Both tools then run the very same libllama/libggml binaries, so the ratio measures
    localinfer's own overhead rather than two builds of llama.cpp.
    """
    import llama_cpp  # noqa: PLC0415 - only needed for this option
    libs = Path(llama_cpp.__file__).parent / "lib"
    return {**os.environ, "LD_LIBRARY_PATH": f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def bench_model(model: Path, llama_bench: Path, threads: int, reps: int, rounds: int,
                env: dict | None = None, llama_bench_args: tuple[str, ...] = (),
                localinfer_args: tuple[str, ...] = (),
                prompts: tuple[int, ...] = (N_PROMPT,), our_env: dict | None = None) -> list[dict]:
    """Run both benchmarks on one model, alternating for several rounds; one row per test.

    Alternating the two tools spreads the load of a shared, noisy machine over both sides. Two
    ratios come out: of the medians over every sample of every round, and the median over rounds
    of each round's ratio (the two tools run back to back), which a machine whose
    speed drifts between rounds disturbs less. The tool that goes first alternates by round.
    """
    theirs: dict[str, list[list[float]]] = {}
    ours: dict[str, list[list[float]]] = {}
    llama_bench_cmd = [str(llama_bench), "-m", str(model), "-p", ",".join(map(str, prompts)),
                       "-n", str(N_GEN), "-t", str(threads), "-r", str(reps), "-o", "json",
                       *llama_bench_args]
    # One `localinfer bench` per length, as `run` loads for a prompt that long; the decode test
    # once (the others decode 2 tokens, not counted).
    localinfer_cmds = [[sys.executable, "-m", "localinfer", "bench", str(model), "-p", str(n),
                        "-n", str(N_GEN if i == 0 else 2), "--threads", str(threads),
                        "--repetitions", str(reps), "--json", *localinfer_args]
                       for i, n in enumerate(prompts)]

    def run_theirs() -> None:
        data = run_json(llama_bench_cmd, f"llama-bench on {model.name}", env)
        for test, samples in parse_llama_bench(data).items():
            theirs.setdefault(test, []).append(samples)

    def run_ours() -> None:
        for i, cmd in enumerate(localinfer_cmds):
            data = run_json(cmd, f"localinfer bench on {model.name}", our_env)
            for test, samples in parse_localinfer(data).items():
                if test.startswith("pp") or i == 0:
                    ours.setdefault(test, []).append(samples)

    for round_no in range(rounds):
        # Swap which tool goes first every round, so a machine that speeds up or slows down
        # within a round favours neither side.
        for step in (run_theirs, run_ours) if round_no % 2 == 0 else (run_ours, run_theirs):
            step()
    rows = []
    for test in (*(test_name(n, 0) for n in prompts), test_name(0, N_GEN)):
        if test not in theirs or test not in ours:
            raise BenchError(f"{test} missing from the results for {model.name}")
        their_all = [v for samples in theirs[test] for v in samples]
        our_all = [v for samples in ours[test] for v in samples]
        their_tps, our_tps = statistics.median(their_all), statistics.median(our_all)
        per_round = [statistics.median(o) / statistics.median(t)
                     for t, o in zip(theirs[test], ours[test])]
        rows.append({
            "model": model.name, "path": str(model), "test": test,
            "llama_bench_tps": their_tps, "llama_bench_stat": "median",
            "localinfer_tps": our_tps, "ratio": our_tps / their_tps if their_tps else None,
            "paired_ratio": statistics.median(per_round), "round_ratios": per_round,
            "paired_ratio_ci95": median_ci(per_round),
            "samples": {"llama_bench": their_all, "localinfer": our_all},
        })
    return rows


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def machine_info(threads: int, reps: int, rounds: int, version: str, engine_libs: str) -> dict:
    """Description of the machine and settings, shown above the results."""
    return {"rounds": rounds, "engine_libs": engine_libs,
        "cpu": cpu_model(), "physical_cores": physical_cores(),
        "logical_cpus": os.cpu_count(), "threads": threads,
        "repetitions": reps, "llama_cpp_python": version,
    }


def _quartiles(values: list[float]) -> str:
    """First and third quartile as "q1–q3" (the single value when there is one)."""
    if len(values) < 2:
        return f"{values[0]:.3f}"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{q1:.3f}–{q3:.3f}"


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median: the order statistics x(k)..x(n+1-k) with the
    largest k whose binomial coverage is at least `confidence`; None below 6 values (no such k)."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0
    while True:
        below += math.comb(n, k) / 2 ** n     # P(fewer than k+1 of n values below the median)
        if 1 - 2 * below < confidence:
            break
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k >= 1 else None


def _interval(values: list[float]) -> str:
    ci = median_ci(values)
    return f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "n/a (under 6 rounds)"


def format_table(machine: dict, rows: list[dict]) -> str:
    """Render the machine line and a markdown table of the rows."""
    stats = {row["llama_bench_stat"] for row in rows}
    stat = stats.pop() if len(stats) == 1 else "median/mean"
    lines = [
        f"Machine: {machine['cpu']}, {machine['physical_cores']} physical cores "
        f"({machine['logical_cpus']} logical), threads={machine['threads']}, "
        f"repetitions={machine['repetitions']} x {machine['rounds']} alternating rounds, "
        f"llama-bench libraries: {machine['engine_libs']}, "
        f"llama-cpp-python {machine['llama_cpp_python']}",
        "",
        f"| model | test | llama-bench t/s ({stat}) | localinfer t/s (median) | ratio "
        "| ratio, median of rounds (quartiles, rounds) | 95% CI of that median |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
        lines.append(
            f"| {row['model']} | {row['test']} | {row['llama_bench_tps']:.2f} "
            f"| {row['localinfer_tps']:.2f} | {ratio} | {row['paired_ratio']:.3f} "
            f"({_quartiles(row['round_ratios'])}, {len(row['round_ratios'])}) "
            f"| {_interval(row['round_ratios'])} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        description="Benchmark localinfer against llama.cpp's llama-bench.")
    parser.add_argument("models", nargs="*", type=Path, help="GGUF model files")
    parser.add_argument("-t", "--threads", type=int, default=physical_cores(),
                        help="threads for both tools (default: physical cores)")
    parser.add_argument("-r", "--repetitions", type=int, default=DEFAULT_REPETITIONS,
                        help=f"repetitions per test (default: {DEFAULT_REPETITIONS})")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the two tools this many times per model (default: 3)")
    parser.add_argument("--wheel-libs", action="store_true",
                        help="run llama-bench on the llama.cpp libraries of the installed "
                             "llama-cpp-python wheel (same engine binaries on both sides)")
    parser.add_argument("--cmake-options", default="",
                        help="build llama-bench and its libraries with these cmake options "
                             "instead of the wheel's CPU features, in a build folder of their own: "
                             "e.g. '-DGGML_NATIVE=ON' (llama.cpp's default build) or "
                             "'-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mtune=generic "
                             "-DCMAKE_CXX_FLAGS=-mtune=generic' (docs/engine.md)")
    parser.add_argument("--shared-build", action="store_true",
                        help="localinfer loads llama-bench's build of the libraries too "
                             "(LLAMA_CPP_LIB_PATH): one build on both sides, a build of your choice")
    parser.add_argument("--build-dir", type=Path,
                        help="llama.cpp download/build cache "
                             "(default: llama.cpp-VERSION in $LOCALINFER_BENCH_CACHE, else "
                             "~/.cache/localinfer-bench)")
    parser.add_argument("--llama-cpp-version",
                        help="llama-cpp-python version to build (default: installed one)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel build jobs (default: CPU count)")
    parser.add_argument("--build-only", action="store_true",
                        help="only build llama-bench and print its path")
    parser.add_argument("--llama-bench-args", default="",
                        help="more llama-bench options, one string: e.g. '-fa 1 -ctk bf16 -ctv f16' "
                             "for localinfer's short-prompt cache, '--repack 0' on a CPU with AMX "
                             "(docs/speed.md)")
    parser.add_argument("--prompts", type=_lengths, default=(N_PROMPT,), metavar="N,N,...",
                        help=f"prefill lengths to measure (default: {N_PROMPT})")
    parser.add_argument("--json", action="store_true",
                        help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    if not args.models and not args.build_only:
        parser.error("give at least one GGUF model, or --build-only")
    if args.wheel_libs and args.shared_build:
        parser.error("--wheel-libs and --shared-build name two different builds; give one")
    return args


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of lengths: {text!r}") from None
    if not lengths or min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise argparse.ArgumentTypeError(f"lengths must be positive and distinct: {text!r}")
    return lengths


def run(args: argparse.Namespace) -> None:
    """Build llama-bench if needed, benchmark every model, print results."""
    version = args.llama_cpp_version or installed_llama_cpp_version()
    build_dir = args.build_dir or source_root(version)
    options = tuple(shlex.split(args.cmake_options)) or None
    llama_bench = ensure_llama_bench(build_dir.expanduser(), version, args.jobs, options,
                                     build_name_for(options))
    if args.build_only:
        print(llama_bench)
        return
    for model in args.models:
        if not model.is_file():
            raise BenchError(f"model file not found: {model}")
    our_env = ({**os.environ, "LLAMA_CPP_LIB_PATH": str(llama_bench.parent)}
               if args.shared_build else None)
    rows = []
    for model in args.models:
        rows.extend(bench_model(model, llama_bench, args.threads, args.repetitions, args.rounds,
                                wheel_lib_env() if args.wheel_libs else None,
                                llama_bench_args=tuple(shlex.split(args.llama_bench_args)),
                                prompts=args.prompts, our_env=our_env))
    libs = "the wheel's" if args.wheel_libs else "its own build"
    if args.cmake_options:
        libs += f" ({args.cmake_options})"
    if args.shared_build:
        libs += ", loaded by localinfer too"
    machine = machine_info(args.threads, args.repetitions, args.rounds, version, libs)
    if args.json:
        print(json.dumps({"machine": machine, "llama_bench": str(llama_bench),
                          "results": rows}, indent=2))
    else:
        print(format_table(machine, rows))


def main(argv: list[str] | None = None) -> int:
    """Entry point; turns BenchError into one error line and exit code 1."""
    try:
        run(parse_args(argv))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
