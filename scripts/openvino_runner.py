#!/usr/bin/env python3
"""Replay recorded static-graph calls on the OpenVINO execution provider with CPU fallback off.

Runs inside the venv scripts/openvino_check.py makes (onnxruntime-openvino and numpy, nothing of
localinfer: that package replaces onnxruntime, so it cannot share the project's env). Both sides of
the calls' format are here: the check imports recording() and save_calls() (onnxruntime and numpy
only) and writes with them, in the project's env, WORK/calls.json and WORK/feeds.npz: for each
session call the CPU provider made, which graph file, the cache position (n_past) and rows (n),
and every input except the KV cache (a real model's or a --tiny config's alike). This script
owns its own cache, as StaticRunner does: each call gets the whole cache as past_* and the n new
rows it returns as new_* are written at n_past (StaticRunner._call's last loop, the only logic
copied). Ids, masks and rope rows are the project's own, recorded, so none of that is duplicated.

Usage (the check runs it; by hand for a look):

    VENV/bin/python scripts/openvino_runner.py WORK [--threads 2] [--option precision=FP32]
    VENV/bin/python scripts/openvino_runner.py --placement GRAPH.onnx   # which nodes need the CPU

Writes WORK/ov_logits.npy ([positions, n_vocab]) and WORK/ov.json; when a session cannot be made
without CPU fallback, prints {"error": ORT's first line} and exits 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnxruntime as ort

PROVIDER = "OpenVINOExecutionProvider"


# -- the recording side, run by openvino_check.py in the project's env (no OpenVINO there) -----
@contextlib.contextmanager
def recording(calls: list):
    """ORT sessions made inside record, per run, the graph and every non-cache input they got.

    StaticRunner binds the cache once (bind_ortvalue_input) and everything else each call
    (bind_cpu_input), so the per-call inputs are exactly what bind_cpu_input sees."""
    base = ort.InferenceSession

    class Binding:
        def __init__(self, real):
            self.real, self.inputs = real, {}

        def bind_cpu_input(self, name, array):
            self.inputs[name] = np.array(array, copy=True)
            self.real.bind_cpu_input(name, array)

        def __getattr__(self, name):
            return getattr(self.real, name)

    class Recording(base):
        def __init__(self, path, *args, **kwargs):
            super().__init__(path, *args, **kwargs)
            self.graph = str(path)

        def io_binding(self):
            return Binding(super().io_binding())

        def run_with_iobinding(self, io, *args, **kwargs):
            calls.append((self.graph, dict(io.inputs)))
            return super().run_with_iobinding(io.real, *args, **kwargs)

    ort.InferenceSession = Recording
    try:
        yield
    finally:
        ort.InferenceSession = base


def save_calls(calls: list, work: Path) -> None:
    """calls.json and feeds.npz for the runner. Every call is full (one T-token prefill, then
    T=1), so its rows n are its width and n_past their running sum; the runner needs both."""
    assert calls, "no call recorded: does StaticRunner still run through io_binding()?"
    meta, arrays, n_past = [], {}, 0
    for i, (graph, inputs) in enumerate(calls):
        n = inputs["input_ids"].shape[1]
        meta.append({"graph": graph, "n_past": n_past, "n": n, "inputs": sorted(inputs)})
        arrays.update({f"{i}:{k}": v for k, v in inputs.items()})
        n_past += n
    (work / "calls.json").write_text(json.dumps(meta))
    np.savez(work / "feeds.npz", **arrays)


# -- the replay side, run here in the OpenVINO venv -----------------------------------------------
def session(graph: str, threads: int, options: dict[str, str], strict: bool = True):
    """The graph on OpenVINO's CPU device; strict: every node on OpenVINO or no session at all."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if strict:
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    else:                   # verbose: ORT logs each EP's nodes ("Node(s) placed on [...]")
        so.log_severity_level = 0
    providers = [(PROVIDER, {"device_type": "CPU", "num_of_threads": str(threads), **options})]
    return ort.InferenceSession(graph, so, providers=providers if strict else
                                providers + ["CPUExecutionProvider"])


def first_line(error: Exception) -> str:
    text = str(error).strip()
    # ORT repeats the message after a coloured log prefix: keep the first sentence block.
    return (text.splitlines()[0] if text else type(error).__name__).split("\x1b[")[0].strip()


def replay(work: Path, threads: int, options: dict[str, str]) -> dict:
    calls = json.loads((work / "calls.json").read_text())
    feeds = np.load(work / "feeds.npz")
    sessions, buffers = {}, {}
    started = time.perf_counter()
    for graph in dict.fromkeys(c["graph"] for c in calls):
        try:
            sessions[graph] = session(graph, threads, options)
        except Exception as e:              # the op-coverage finding: report it, do not hide it
            print(json.dumps({"error": first_line(e), "graph": graph,
                              "version": version("onnxruntime-openvino")}))
            sys.exit(3)
    compile_s = time.perf_counter() - started
    rows, decode_s, decodes = [], 0.0, 0
    for i, call in enumerate(calls):
        s = sessions[call["graph"]]
        for x in s.get_inputs():           # one cache for both graphs: same names and shapes
            if x.name.startswith("past_") and x.name not in buffers:
                buffers[x.name] = np.zeros(x.shape, np.float32)
        feed = {name: feeds[f"{i}:{name}"] for name in call["inputs"]}
        feed.update({x.name: buffers[x.name] for x in s.get_inputs() if x.name in buffers})
        names = [o.name for o in s.get_outputs()]
        t = time.perf_counter()
        outs = dict(zip(names, s.run(names, feed)))
        if call["n"] == 1:
            decode_s, decodes = decode_s + time.perf_counter() - t, decodes + 1
        p, n = call["n_past"], call["n"]
        for name, new in outs.items():     # as StaticRunner: the n new rows land at n_past
            if name.startswith("new_"):
                buffers["past_" + name[4:]][:, :, p:p + n] = new[:, :, :n]
        rows.append(outs["logits"][0, :n])
    np.save(work / "ov_logits.npy", np.concatenate(rows))
    return {"version": version("onnxruntime-openvino"), "options": options, "compile_s": compile_s,
            "decode_ms": 1000 * decode_s / max(decodes, 1)}


def placement(graph: str, threads: int, options: dict[str, str]) -> None:
    """Make the session with fallback allowed; ORT's verbose log (stderr) names the nodes each
    provider took, which the check reads."""
    session(graph, threads, options, strict=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", nargs="?", type=Path)
    ap.add_argument("--placement", metavar="GRAPH")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an OpenVINO provider option (e.g. precision=FP32)")
    args = ap.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    if args.placement:
        placement(args.placement, args.threads, options)
        return
    result = replay(args.work, args.threads, options)
    (args.work / "ov.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
