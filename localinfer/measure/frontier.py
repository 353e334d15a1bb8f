"""`localinfer frontier`: quantize a model to several types and measure what each costs and gives.

For every type: file size, estimated and measured peak memory, prefill and decode speed (a
`localinfer bench` run in its own process, whose peak RSS is the measured memory), and perplexity,
mean KL and top-1 agreement against the highest-precision variant. A variant is on the efficient
frontier when no other variant is at least as good on quality and on speed (or on quality and on
memory) and better on one of them.

The reference is the source quantized to F16. From a quantized source (a catalogue's Q4_1, say)
that is an upcast: it holds the source's own rounded weights, so the quality columns measure each
type against the source, not against the model as trained, and it is said so (stderr, --json).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from localinfer.backends import LoadOptions, get
from localinfer.fit import memory
from localinfer.gguf.header import read_header
from localinfer.measure import quality
from localinfer.quant import quantize

DEFAULT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
BENCH_PROMPT, BENCH_GEN = 128, 32

# Started by a small launcher so the bench's ru_maxrss is its own, not inherited from this process.
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
out = proc.stdout.read()
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
sys.stdout.write(out.decode())
"""


@dataclass
class Point:
    qtype: str
    path: str
    file_size: int
    memory_estimated: int
    memory_measured: int
    prefill_tps: float
    decode_tps: float
    perplexity: float
    mean_kl: float
    top1_agreement: float
    frontier: bool = False


def measure(source: Path, types: list[str], workdir: Path, *, n_ctx: int, chunks: int,
            threads: int = 0, note: Callable[[str], None] = lambda _: None) -> tuple[Path, list[Point]]:
    """Quantize `source` to each type (cached in `workdir`) and measure every variant."""
    workdir.mkdir(parents=True, exist_ok=True)
    said = upcast_note(source)
    if said:
        note(said)
    reference = _variant(source, "F16", workdir, note)
    text = quality.default_text()
    options = LoadOptions(n_ctx=n_ctx, n_threads=threads, n_batch=n_ctx)
    backend = get("llama.cpp")
    ref_session = backend.load(reference, options)
    tokens = quality.tokens_for(ref_session, text)
    points = []
    for qtype in types:
        path = _variant(source, qtype, workdir, note)
        note(f"{qtype}: measuring speed, memory and quality")
        bench, peak = _bench(path, threads)
        session = backend.load(path, options)
        scores = quality.evaluate(session, tokens, n_ctx=n_ctx, reference=ref_session,
                                  max_chunks=chunks)
        session.close()
        facts = memory.facts_from_file(path)
        estimated = memory.estimate(facts, memory.Request(BENCH_PROMPT + BENCH_GEN + 16,
                                                          repack=memory.cpu_repacks())).total
        points.append(Point(qtype, str(path), path.stat().st_size, estimated, peak,
                            bench["prefill_tps"]["median"], bench["decode_tps"]["median"],
                            scores.perplexity, scores.mean_kl, scores.top1_agreement))
    ref_session.close()
    mark_frontier(points)
    return reference, points


def source_precision(source: Path) -> str | None:
    """The quantized type `source` holds (its file type, else its tensors' types), or None when
    its weights are 16 or 32 bits wide: then the F16 reference is no upcast."""
    header = read_header(source)
    file_type = header.metadata.get("general.file_type")
    named = {n: name for name, n in quantize.QUANT_TYPES.items()}.get(file_type) \
        if type(file_type) is int else None
    if named is None:
        named = "+".join(sorted({t.type_name for t in header.tensors} - quantize.UNQUANTIZED))
    return None if not named or named in quantize.UNQUANTIZED else named


def upcast_note(source: Path) -> str | None:
    """The line that says the reference is an upcast, and what that does to the numbers."""
    upcast = source_precision(source)
    if not upcast:
        return None
    return (f"the F16 reference is {source.name}'s {upcast} weights upcast, not the original "
            f"model: KL and top-1 measure each type against {upcast} (types as precise as it "
            "score near 0); a 16-bit source measures against the model as trained")


def _variant(source: Path, qtype: str, workdir: Path, note: Callable[[str], None]) -> Path:
    path = workdir / f"{quantize.store_name_for(source)}-{qtype}.gguf"
    if not path.exists():
        note(f"{qtype}: quantizing")
        quantize.quantize_file(source, path, qtype, allow_requantize=True)
    return path


def _bench(path: Path, threads: int) -> tuple[dict, int]:
    cmd = [sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "localinfer", "bench", str(path),
           "-p", str(BENCH_PROMPT), "-n", str(BENCH_GEN), "-r", "3", "--json", "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    head, _, body = out.partition("\n")
    code, peak = map(int, head.split())
    if code != 0:
        raise RuntimeError(f"localinfer bench failed on {path.name}")
    return json.loads(body), peak


def mark_frontier(points: list[Point]) -> None:
    """Set `frontier` on every point not dominated in (quality, speed) or (quality, memory)."""
    for p in points:
        p.frontier = not (_dominated(p, points, lambda x: x.decode_tps) and
                          _dominated(p, points, lambda x: -x.memory_measured))


def _dominated(p: Point, points: list[Point], better: Callable[[Point], float]) -> bool:
    # Quality is KL against the reference: lower is better.
    return any(q is not p and q.mean_kl <= p.mean_kl and better(q) >= better(p)
               and (q.mean_kl < p.mean_kl or better(q) > better(p)) for q in points)


def as_rows(points: list[Point]) -> list[list[str]]:
    mb = lambda n: f"{n / 1e6:.0f}"   # noqa: E731 - a local formatter
    return [[p.qtype + (" *" if p.frontier else ""), mb(p.file_size), mb(p.memory_estimated),
             mb(p.memory_measured), f"{p.prefill_tps:.0f}", f"{p.decode_tps:.1f}",
             f"{p.perplexity:.3f}", f"{p.mean_kl:.4f}", f"{p.top1_agreement:.1%}"] for p in points]


HEADERS = ["TYPE", "SIZE MB", "MEM EST MB", "MEM PEAK MB", "PREFILL t/s", "DECODE t/s", "PPL",
           "KL", "TOP-1"]


def to_json(reference: Path, points: list[Point], upcast_from: str | None = None) -> str:
    """`upcast_from`: the quantized type the F16 reference was made from (None: a 16-bit source)."""
    return json.dumps({"reference": str(reference), "reference_upcast_from": upcast_from,
                       "variants": [asdict(p) for p in points]}, indent=2)


def plot(points: list[Point], path: Path, title: str) -> None:
    """Quality (KL, lower is better) against decode speed and against size; frontier joined."""
    fig, axes = figure(2)
    for ax, key, label in ((axes[0], "decode_tps", "decode tokens/s"),
                           (axes[1], "file_size", "file size (MB)")):
        scale = 1e6 if key == "file_size" else 1
        xs = [getattr(p, key) / scale for p in points]
        ax.scatter(xs, [p.mean_kl for p in points], color="tab:blue")
        for p, x in zip(points, xs):
            ax.annotate(p.qtype, (x, p.mean_kl), textcoords="offset points", xytext=(4, 4))
        front = sorted((getattr(p, key) / scale, p.mean_kl) for p in points if p.frontier)
        ax.plot([f[0] for f in front], [f[1] for f in front], color="tab:red", label="frontier")
        ax.set_xlabel(label)
        ax.set_ylabel("mean KL vs F16 (nats/token)")
        ax.legend()
    save(fig, path, title)


def figure(panels: int):
    """A figure of `panels` plots side by side (matplotlib on the file backend): (fig, axes)."""
    return pyplot().subplots(1, panels, figsize=(5.5 * panels, 4.5))


def pyplot():
    """matplotlib's pyplot on the file backend; a UsageError naming the extra without it."""
    try:
        import matplotlib
    except ImportError as e:
        from localinfer.errors import UsageError
        raise UsageError("--plot needs matplotlib: pip install 'localinfer[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, title: str) -> None:
    """Title the figure and write it as PNG atomically (a partial file, then a rename)."""
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.partial")
    fig.savefig(tmp, format="png", dpi=110)
    pyplot().close(fig)
    tmp.replace(path)
