#!/usr/bin/env python3
"""Images and audio through localinfer against llama.cpp's own llama-mtmd-cli, built from the same
vendored source and run on the same engine libraries (the wheel's): the greedy tokens for each
medium, then image encode time and time to first token side by side, rounds alternating.

    python scripts/bench_multimodal.py                       # tiny random projectors on SmolLM2
    python scripts/bench_multimodal.py --model M.gguf --mmproj P.gguf --image a.png --audio c.wav

Without --model it writes the test material of tests/mmproj_writer.py (SmolLM2 with SmolVLM's
image tokens, a tiny idefics3 and ultravox projector, three images and a clip) into a temporary
folder: random weights pin the mechanics, never quality. Both sides use a q8_0 KV cache (no
steering: the same kernels), -b/-ub 512, flash attention, the chat template (--jinja).

Ours is timed in process: encode = libmtmd's encode calls, TTFT = prefill start (media encoded,
text and embeddings decoded) to the first token's logits; the model loaded once, nothing cached
between rounds. Theirs from its log: the wall time a round's stderr/stdout arrive at, mapped onto
its log's own clock, from the first chunk's evaluation to the first answer byte; encode = the
sum of its "mtmd batch encoding done in N ms" lines (whole milliseconds). A ratio is theirs /
ours: above 1, ours is faster. Writes a table to stdout; the check exits 1 on a token mismatch.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import llama_tools

PROMPT = "Describe this."
_STAMP = re.compile(r"^(\d+)\.(\d\d)\.(\d\d\d)\.(\d\d\d) ")   # minutes.s.ms.us
_ENCODED = re.compile(r"mtmd batch encoding done in (\d+) ms")


def material(folder: Path) -> list[tuple[str, Path, Path, list[str]]]:
    """(case, model, projector, media args) for the test material written into `folder`."""
    common.use_tests()
    from media_files import png, wav
    from mmproj_writer import smolvlm_text_model, write_idefics3, write_ultravox
    model = smolvlm_text_model(common.model_file("smollm2"), folder / "smolvlm-text.gguf")
    vision = write_idefics3(folder / "mmproj-vision.gguf")
    audio = write_ultravox(folder / "mmproj-audio.gguf")
    images = {}
    for w, h in ((32, 32), (100, 30), (200, 200)):
        images[w, h] = folder / f"{w}x{h}.png"
        images[w, h].write_bytes(png(w, h, seed=w))
    clip = folder / "clip.wav"
    clip.write_bytes(wav(1.0))
    return [*((f"image {w}x{h}", model, vision, ["--image", str(p)]) for (w, h), p in images.items()),
            ("two images", model, vision, ["--image", str(images[32, 32]),
                                           "--image", str(images[200, 200])]),
            ("audio 1 s", model, audio, ["--audio", str(clip)])]


def theirs(cli: Path, model: Path, mmproj: Path, media: list[str], tokens: int,
           threads: int, extra: tuple[str, ...] = ()) -> tuple[str, float, float]:
    """llama-mtmd-cli's (answer, encode ms, TTFT ms) on the wheel's libraries; `extra`: more of
    its options (scripts/multimodal_check.py: -ngl)."""
    lib = Path(__import__("llama_cpp").__file__).parent / "lib"
    cmd = [str(cli), "-m", str(model), "--mmproj", str(mmproj), *media, "-p", PROMPT, "--temp",
           "0", "-n", str(tokens), "-t", str(threads), "--jinja", "-c", "4096", "-b", "512",
           "-ub", "512", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", *extra, "-v"]
    env = {**os.environ, **{var: f"{lib}:{os.environ.get(var, '')}"      # Linux; a Mac
                            for var in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")}}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    offsets, start, encode, first, out = [], [], [0], [], []

    def read_log() -> None:
        for raw in proc.stderr:
            now, line = time.perf_counter(), raw.decode("utf-8", "replace")
            stamp = _STAMP.match(line)
            if stamp:
                m, s, ms, us = (int(g) for g in stamp.groups())
                logged = m * 60 + s + ms / 1e3 + us / 1e6
                offsets.append(now - logged)
                if not start and "formatted_chat.prompt" in line:
                    start.append(logged)
            hit = _ENCODED.search(line)
            if hit:
                encode[0] += int(hit.group(1))
    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    while chunk := proc.stdout.read1(4096):
        if not first and chunk.strip():
            first.append(time.perf_counter())
        out.append(chunk)
    proc.wait()
    reader.join(timeout=10)
    if proc.returncode != 0 or not start or not first:
        raise SystemExit(f"error: llama-mtmd-cli failed (exit {proc.returncode}): {' '.join(cmd)}")
    ttft = (first[0] - min(offsets) - start[0]) * 1000
    return b"".join(out).decode("utf-8", "replace").strip(), float(encode[0]), ttft


class Ours:
    """One SmolLM2-sized session with its projector, as `run --kv-type q8_0` loads it."""

    def __init__(self, model: Path, mmproj: Path, threads: int, gpu_layers: int = -1) -> None:
        from localinfer.backends import LoadOptions
        from localinfer.backends.llama.session import LlamaCppSession
        self.session = LlamaCppSession(model, LoadOptions(n_ctx=4096, n_threads=threads,
                                                          kv_type="q8_0", mmproj=str(mmproj),
                                                          gpu_layers=gpu_layers))

    def answer(self, media: list[str], tokens: int) -> tuple[str, float, float]:
        from localinfer import media as checks
        from localinfer.engine.kv import KVCache
        from localinfer.engine.prompt import PromptText, prompt_tokens
        session, projector = self.session, self.session.media
        given = tuple(checks.read_path(path, flag[2:])
                      for flag, path in zip(media[::2], media[1::2]))
        projector._embd.clear()                  # encode every round, as a fresh process does
        session.reset()
        # From the chat's rendering (theirs: eval_message), media decoded and preprocessed too.
        encoded, start = projector.encode_s, time.perf_counter()
        prompt = prompt_tokens(session, PromptText(PROMPT, media=given))
        cache = KVCache(session)
        logits, _ = cache.prefill(prompt)
        out = [int(logits.argmax())]
        ttft = (time.perf_counter() - start) * 1000
        while len(out) < tokens and not session.is_eog(out[-1]):
            out.append(int(cache.step(out[-1]).argmax()))
        # Control tokens spelled out, as llama-mtmd-cli prints them (run prints them as nothing).
        text = b"".join(session.piece(t) or session.token_text(t).encode()
                        for t in out if not session.is_eog(t))
        return text.decode("utf-8", "replace").strip(), (projector.encode_s - encoded) * 1000, ttft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=common.gguf_file, help="a model file (default: the test "
                        "material, SmolLM2 with tiny random projectors)")
    parser.add_argument("--mmproj", type=common.gguf_file, help="its projector")
    parser.add_argument("--image", action="append", default=[], help="an image (repeatable)")
    parser.add_argument("--audio", action="append", default=[], help="an audio clip")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--tokens", type=int, default=24, help="answer tokens compared")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if bool(args.model) != bool(args.mmproj):
        parser.error("--model and --mmproj go together")
    try:
        cli = llama_tools.ensure_tool("llama-mtmd-cli")
    except llama_tools.BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        cases = material(Path(tmp)) if not args.model else [
            ("given", args.model, args.mmproj,
             [*(x for p in args.image for x in ("--image", p)),
              *(x for p in args.audio for x in ("--audio", p))])]
        return _compare(cases, cli, args)


def _compare(cases, cli: Path, args) -> int:
    mismatches, loaded = 0, {}
    layers = getattr(args, "gpu_layers", None)        # multimodal_check: the same on both sides
    extra = ("-ngl", str(layers)) if layers is not None else ()
    print("| case | tokens equal | encode ms ours / theirs | TTFT ms ours / theirs | TTFT ratio |")
    print("|---|---|---|---|---|")
    for name, model, mmproj, media in cases:
        if (model, mmproj) not in loaded:
            loaded[model, mmproj] = Ours(model, mmproj, args.threads,
                                         -1 if layers is None else layers)
        ours = loaded[model, mmproj]
        mine = ours.answer(media, args.tokens)
        other = theirs(cli, model, mmproj, media, args.tokens, args.threads, extra)
        same = mine[0] == other[0]
        mismatches += not same
        if not same:
            print(f"ours:   {mine[0]!r}\ntheirs: {other[0]!r}", file=sys.stderr)
        timed = {"ours": [], "theirs": []}
        for _ in range(args.rounds):          # alternating, so a slow spell hits both sides
            timed["theirs"].append(theirs(cli, model, mmproj, media, 1, args.threads,
                                          extra)[1:])
            timed["ours"].append(ours.answer(media, 1)[1:])
        enc = {k: statistics.median(e for e, _ in v) for k, v in timed.items()}
        ttft = {k: statistics.median(t for _, t in v) for k, v in timed.items()}
        print(f"| {name} | {'yes' if same else 'NO'} | {enc['ours']:.1f} / {enc['theirs']:.0f} | "
              f"{ttft['ours']:.0f} / {ttft['theirs']:.0f} | {ttft['theirs'] / ttft['ours']:.2f} |",
              flush=True)
    for ours in loaded.values():
        ours.session.close()
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
