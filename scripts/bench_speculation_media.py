#!/usr/bin/env python3
"""Speculative vs plain decoding with an image in the prompt (docs/multimodal.md): the tasks of
localinfer/measure/speculation.py, each after a picture, plain and speculative runs alternating
on one loaded model, medians; the greedy outputs must be the same.

    LOCALINFER_HOME=... python scripts/bench_speculation_media.py [N_GEN] [REPETITIONS] [--no-image]

Writes the test material of tests/mmproj_writer.py (SmolLM2 with SmolVLM's image tokens and a
tiny random-weight idefics3 projector) into a temporary folder: random weights pin the mechanics
and the cost of drafting around an image, never quality. Drafters: adaptive lookup (`auto` here)
and the self-draft (a Q4_0 of the target, made once with the quantizer). `--no-image`: the same
tasks without the picture, on the same model, for comparison. One JSON line per drafter; exits 1
when a greedy output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import common  # scripts/common.py

from localinfer import media
from localinfer.backends import LoadOptions
from localinfer.engine.load import load_model
from localinfer.engine.prompt import chat_media_tokens, chat_tokens
from localinfer.measure import speculation
from localinfer.models import refs
from localinfer.speculate import choose

DRAFTERS = ("lookup", "self")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n_gen", type=int, nargs="?", default=64, help="most tokens generated")
    parser.add_argument("repetitions", type=int, nargs="?", default=5, help="timed repetitions")
    parser.add_argument("--no-image", action="store_true", help="the tasks without the picture")
    args = parser.parse_args()
    common.use_tests()
    from media_files import png
    from mmproj_writer import smolvlm_text_model, write_idefics3
    same = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = smolvlm_text_model(common.model_file("smollm2"), folder / "smolvlm-bench.gguf")
        projector = write_idefics3(folder / "mmproj-bench.gguf")
        (folder / "photo.png").write_bytes(png(200, 200, seed=200))
        options = LoadOptions(n_ctx=1024, mmproj=str(projector))
        ref = refs.ModelRef(display=model.name, spec=None, quant=None, path=model)
        loaded = load_model(ref, model, backend="auto", options=options)
        picture = media.read_path(folder / "photo.png", "image")
        tasks = {name: _tokens(loaded.session, text, None if args.no_image else picture)
                 for name, text in speculation.CHAT_TASKS.items()}
        for choice in DRAFTERS:
            drafter = choose.open_drafter(choice, loaded, options=LoadOptions(n_ctx=1024),
                                          offline=True, notify=common.to_stderr)
            result = speculation.measure(loaded, drafter, n_gen=args.n_gen,
                                         repetitions=args.repetitions, tasks=tasks,
                                         progress=common.to_stderr)
            result.update(choice=choice, image=not args.no_image)
            same &= all(t["identical_greedy_output"] for t in result["tasks"].values())
            print(json.dumps(result), flush=True)
            drafter.close()
        loaded.session.close()
    sys.exit(0 if same else 1)


def _tokens(session, text: str, picture) -> list[int]:
    if picture is None:
        return chat_tokens(session, [{"role": "user", "content": text}])
    turn = [{"role": "user", "content": media.MARKER + text}]
    return chat_media_tokens(session, turn, None, [picture])


if __name__ == "__main__":
    main()
