"""The memory estimate against the measured peak resident memory of real `localinfer run`s (later
runs, first runs that probe speculation's exactness, long prompts), and its parts on a described
model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localinfer.fit import memory
from localinfer.measure import quality
from localinfer.quant import quantize

CONTEXTS = (512, 4096)


class Variants:
    """Both real models in each type, made from the shipped files with the quantizer on first use
    (a type whose tests run only under exhaustive costs nothing by default)."""

    def __init__(self, shipped: dict[str, tuple[Path, str]], workdir: Path) -> None:
        self.shipped, self.workdir, self.files = shipped, workdir, {}

    def __getitem__(self, key: tuple[str, str]) -> Path:
        if key not in self.files:
            label, qtype = key
            src, shipped = self.shipped[label]
            if qtype == shipped:
                self.files[key] = src
            else:
                self.files[key] = self.workdir / f"{label}-{qtype}.gguf"
                quantize.quantize_file(src, self.files[key], qtype, allow_requantize=True)
        return self.files[key]


@pytest.fixture(scope="module")
def variants(smollm_path: Path, gemma_path: Path, tmp_path_factory) -> Variants:
    return Variants({"smollm": (smollm_path, "Q4_1"), "gemma": (gemma_path, "Q4_K_M")},
                    tmp_path_factory.mktemp("variants"))


# A child's ru_maxrss starts from its parent's size at fork, and this test process is large; so a
# small launcher process starts the run and reports the run's own peak.
_LAUNCHER = """
import os, subprocess, sys
stdin = open(os.environ.get("PEAK_STDIN", os.devnull), "rb")
proc = subprocess.Popen(sys.argv[1:], stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""


def peak_rss_of_run(model: Path, ctx: int, *args: str, home: Path | None = None,
                    stdin: Path | None = None) -> int:
    """Peak resident bytes of one `localinfer run` process (by default a short prompt without
    drafting; `args` replace that, `home` is its LOCALINFER_HOME, `stdin` a file piped in)."""
    args = args or ("Once upon a time", "-n", "8", "--temp", "0", "--raw", "--draft", "none")
    env = {**os.environ, **({"LOCALINFER_HOME": str(home)} if home else {}),
           **({"PEAK_STDIN": str(stdin)} if stdin else {})}
    out = subprocess.run([sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "localinfer", "run",
                          str(model), *args, "--ctx", str(ctx)], capture_output=True, text=True,
                         check=True, env=env).stdout
    code, peak = map(int, out.split())
    assert code == 0
    return peak


def peaks(model: Path) -> dict[int, int]:
    """The peak of a run at each of CONTEXTS, both at once (peak memory does not mind sharing)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(CONTEXTS)) as pool:
        return dict(zip(CONTEXTS, pool.map(lambda ctx: peak_rss_of_run(model, ctx), CONTEXTS)))


EXHAUSTIVE = pytest.mark.exhaustive


# Each weight type keeps one model by default: Q8_0 (not repacked) and Q4_0 (repacked) on SmolLM2,
# Q4_K_M (repacked) on Gemma 3 as shipped. exhaustive: gemma-Q8_0, gemma-Q4_0 and smollm-Q4_K_M
# are a second model of a kept case's type (the same estimate and repack rule).
@pytest.mark.slow
@pytest.mark.parametrize("label, qtype", [
    ("smollm", "Q8_0"), pytest.param("gemma", "Q8_0", marks=EXHAUSTIVE),
    pytest.param("smollm", "Q4_K_M", marks=EXHAUSTIVE), ("gemma", "Q4_K_M"),
    ("smollm", "Q4_0"), pytest.param("gemma", "Q4_0", marks=EXHAUSTIVE)])
def test_estimate_within_ten_percent_of_peak_rss(variants, label: str, qtype: str):
    facts = memory.facts_from_file(variants[label, qtype])
    measured_at = peaks(variants[label, qtype])
    for ctx in CONTEXTS:
        estimated = memory.estimate(facts, memory.Request(ctx, repack=memory.cpu_repacks())).total
        measured = measured_at[ctx]
        assert abs(estimated / measured - 1) <= 0.10, (label, qtype, ctx, estimated, measured)


# exhaustive: SmolLM2's first runs repeat Gemma 3's on the same estimate; Gemma 3's is the
# likelier to break (its 262k-token logits rows, its repacked Q4_K) and, with its sliding window,
# the cheaper.
@pytest.mark.slow
@pytest.mark.parametrize("label", [pytest.param("smollm", marks=EXHAUSTIVE), "gemma"])
def test_estimate_holds_on_first_runs_and_long_prompts(smollm_path, gemma_path, tmp_path,
                                                       label: str):
    """A model's first run probes speculation's exactness (a 320-token prefill, batches of up to
    8 rows of logits) and a long prompt fills whole micro-batches: the estimate covers both."""
    model = smollm_path if label == "smollm" else gemma_path
    facts = memory.facts_from_file(model)
    doc = tmp_path / "doc.txt"
    doc.write_text(quality.default_text()[:4000], encoding="utf-8")   # ~1,000 tokens
    for ctx in CONTEXTS:
        estimated = memory.estimate(facts, memory.Request(ctx, repack=memory.cpu_repacks())).total
        home = tmp_path / f"home{ctx}"      # no probe result yet: this is the model's first run
        first = peak_rss_of_run(model, ctx, "Once upon a time", "-n", "8", "--temp", "0", "--raw",
                                home=home)
        assert (home / "cache" / "exact_batch.json").is_file()        # the probe did run
        assert abs(estimated / first - 1) <= 0.10, (label, ctx, "first", estimated, first)
        if ctx > 1024:
            long = peak_rss_of_run(model, ctx, "-", "-n", "8", "--temp", "0", "--raw", "--draft",
                                   "none", "--no-cache", home=home, stdin=doc)
            assert abs(estimated / long - 1) <= 0.10, (label, ctx, "long", estimated, long)


GEMMA_LIKE = memory.ModelFacts(
    architecture="gemma3", file_size=250_000_000, n_layer=18, n_embd=640, n_ff=2048,
    n_vocab=262_144, kv_dims=(1 * (256 + 256),) * 18,
    swa_layers=tuple((il + 1) % 6 != 0 for il in range(18)), sliding_window=512,
    repackable_bytes=10_000_000, context_length=32768)


@pytest.mark.parametrize("request_, kv_bytes", [
    (memory.Request(4096), 18 * 4096 * 512 * 2),                                  # all full size
    (memory.Request(4096, swa_full=False), 3 * 4096 * 512 * 2 + 15 * 1024 * 512 * 2),
    (memory.Request(4096, kv_type="q8_0"), int(18 * 4096 * 512 * 34 / 32)),
    (memory.Request(300), 18 * 512 * 512 * 2),                                    # padded to 256
])
def test_kv_cache_per_layer_and_window(request_, kv_bytes):
    assert memory.kv_cache_bytes(GEMMA_LIKE, request_) == kv_bytes


def test_logits_grow_with_vocabulary_and_rows():
    one = memory.estimate(GEMMA_LIKE, memory.Request(512, logits_rows=1))
    many = memory.estimate(GEMMA_LIKE, memory.Request(512, logits_rows=64))
    assert many.compute - one.compute == 2 * 63 * 262_144 * 4


def test_facts_of_gemma(gemma_path: Path):
    facts = memory.facts_from_file(gemma_path)
    assert facts.n_layer == 18 and facts.n_vocab == 262_144 and facts.sliding_window == 512
    assert sum(facts.swa_layers) == 15


def test_run_logits_rows_cover_speculation():
    from localinfer.speculate import exactness
    assert memory.RUN_LOGITS_ROWS == exactness.MAX_PROBED
