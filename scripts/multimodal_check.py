#!/usr/bin/env python3
"""Images through localinfer against llama.cpp's own llama-mtmd-cli on a real vision model, where
one can be fetched: a machine with a GPU (also `scripts/gpu_check.py --multimodal`), a Mac
(Metal), or any CPU with the Hub in reach.

    python scripts/multimodal_check.py                          # smolvlm2-256m-video-instruct
    python scripts/multimodal_check.py --model gemma-3-4b-it --gpu-layers 0

1. The catalogue model (or an `hf:OWNER/REPO`) is pulled with its projector by localinfer's own
   pull; a model or projector that cannot be fetched is one `skip:` line and exit 2, before
   anything is built.
2. llama-mtmd-cli is built from the vendored llama.cpp of the installed llama-cpp-python
   (scripts/llama_tools.py) and run on the wheel's own libraries, as scripts/bench_multimodal.py
   runs it.
3. A fixed picture is drawn here (256 x 192: a red disc on a blue-to-green ramp), no file needed.
4. `localinfer run MODEL "Describe this." --image PICTURE --temp 0` must answer the same greedy
   tokens as llama-mtmd-cli (both: the chat template, a q8_0 KV cache, --gpu-layers layers on
   the GPU and the projector with them); then bench_multimodal's side-by-side rounds: the same
   tokens in process, image encode time and time to first token, ours and theirs, and the TTFT
   ratio (theirs / ours: above 1 ours is faster; the issue's target is 0.95 or more).

Exit 0 when the tokens agree, 1 when they do not (or a step fails), 2 when it cannot check here.
What only this check can show is listed in docs/multimodal.md ("What only a real model can
confirm").
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import bench_multimodal
import llama_tools

DEFAULT_MODEL = "smolvlm2-256m-video-instruct"
ALL_LAYERS = 99
EXIT_FAILED, EXIT_CANNOT_CHECK = 1, 2
SIDES = (256, 192)


class Skip(Exception):
    """The check cannot run here (no model to fetch, no tool to build): one `skip:` line."""


def picture(path: Path) -> Path:
    """A fixed PNG: a red disc on a ramp from blue (left) to green (right)."""
    width, height = SIDES
    rows = bytearray()
    for y in range(height):
        rows.append(0)                         # filter type 0 for each row
        for x in range(width):
            inside = (x - width / 2) ** 2 + (y - height / 2) ** 2 < (height / 4) ** 2
            ramp = x * 255 // (width - 1)
            rows += bytes((220, 30, 30)) if inside else bytes((0, ramp, 255 - ramp))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(bytes(rows))) + chunk(b"IEND", b""))
    return path


def fetch(model: str) -> tuple[Path, Path]:
    """The model file and its projector, pulled by localinfer's own rules into LOCALINFER_HOME's
    store (kept: a second run pulls nothing); Skip when either cannot be had."""
    from localinfer.errors import LocalinferError
    from localinfer.models import refs
    from localinfer.models.projector import beside
    notes: list[str] = []
    try:
        _, catalogue, store = refs.context()
        ref = refs.parse_ref(model, catalogue)
        path = refs.locate(ref, store, offline=False, progress=False, notify=notes.append)
    except LocalinferError as e:
        raise Skip(f"cannot fetch {model}: {e}") from None
    projector = beside(path)
    if projector is None:
        why = notes[-1] if notes else "it has none"
        raise Skip(f"{model} has no projector on disk after its pull: {why}")
    return path, projector


def run_answer(model: Path, projector: Path, image: Path, tokens: int, gpu_layers: int) -> str:
    """`localinfer run --image`'s greedy answer, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "localinfer", "run", str(model), bench_multimodal.PROMPT,
         "--image", str(image), "--mmproj", str(projector), "--temp", "0", "-n", str(tokens),
         "--kv-type", "q8_0", "--ctx", "4096", "--no-cache", "--draft", "none",
         "--gpu-layers", str(gpu_layers)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise llama_tools.BenchError(f"localinfer run --image failed: "
                                     f"{done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def check(model: str, *, gpu_layers: int = ALL_LAYERS, tokens: int = 24, rounds: int = 3,
          threads: int = 2, jobs: int = 2) -> int:
    """The whole check; Skip when it cannot run here. 0: the same tokens, 1: not."""
    path, projector = fetch(model)             # first: nothing is built for a model not here
    try:
        cli = llama_tools.ensure_tool("llama-mtmd-cli", jobs=jobs)
    except llama_tools.BenchError as e:
        raise Skip(f"cannot build llama-mtmd-cli: {e}") from None
    ngl = ("-ngl", str(gpu_layers))
    with tempfile.TemporaryDirectory() as tmp:
        image = ["--image", str(picture(Path(tmp) / "picture.png"))]
        ours = run_answer(path, projector, Path(image[1]), tokens, gpu_layers)
        theirs = bench_multimodal.theirs(cli, path, projector, image, tokens, threads, ngl)[0]
        same = ours == theirs
        print(f"{model} ({path.name}, {projector.name}), --gpu-layers {gpu_layers}: "
              f"localinfer run --image and llama-mtmd-cli, {tokens} greedy tokens: "
              f"{'the same' if same else 'DIFFERENT'}")
        if not same:
            print(f"ours:   {ours!r}\ntheirs: {theirs!r}", file=sys.stderr)
        timing = argparse.Namespace(tokens=tokens, rounds=rounds, threads=threads,
                                    gpu_layers=gpu_layers)
        compared = bench_multimodal._compare(
            [(f"picture {SIDES[0]}x{SIDES[1]}", path, projector, image)], cli, timing)
    return EXIT_FAILED if not same or compared else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a catalogue vision model or hf:OWNER/REPO (default: {DEFAULT_MODEL})")
    parser.add_argument("--gpu-layers", type=int, default=ALL_LAYERS,
                        help=f"layers on the GPU for both tools (default {ALL_LAYERS}: all; 0: CPU)")
    parser.add_argument("--tokens", type=int, default=24, help="answer tokens compared")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, alternating")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both tools")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel build jobs")
    args = parser.parse_args(argv)
    try:
        return check(args.model, gpu_layers=args.gpu_layers, tokens=args.tokens,
                     rounds=args.rounds, threads=args.threads, jobs=args.jobs)
    except Skip as e:
        print(f"skip: multimodal check: {e}", file=sys.stderr)
        return EXIT_CANNOT_CHECK
    except (llama_tools.BenchError, subprocess.SubprocessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
