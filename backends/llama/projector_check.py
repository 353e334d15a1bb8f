"""A projector (mmproj) file tried once in a child process before libmtmd reads it here.

libmtmd (llama.cpp's tools/mtmd/clip.cpp) looks a projector's tensors up by name and builds its
encoder's graph from them without comparing their shapes with its header or with one another: a
patch embedding of another size, a block tensor missing, a projection of the wrong width end in a
GGML_ASSERT (an abort) or a segmentation fault while the graph is built (the warm-up at load), and
a graph that makes another number of tokens than the header promises aborts after an image or a
clip is encoded. Such a file would take the whole process with it, a server and its other clients
too. So before this process loads a projector, a child process loads it as this one would (beside
the model's vocabulary: its weights are not needed) and encodes one small image and one second of
silence, as many as the projector takes, on the CPU (the shapes' faults are the graph's, not a
device's; a GPU the parent already fills could fail the child for want of memory, which says
nothing about the file). A child that dies of an abort or a fault refuses the file in one line
naming it; one that libmtmd refuses cleanly passes on libmtmd's reason; one killed from outside
(SIGKILL: the out-of-memory killer) or out of time is no verdict. The verdict is kept in the
cache (`projectors.json`) under both files' identities (path, device, inode, size, modification
time) and libmtmd's build, so a projector is tried once. What one small image and one clip do
not exercise (another image size's tiles, a GPU kernel's own checks) is not tried.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from localinfer.errors import LocalinferError, UsageError

VERSION = 1                   # part of the key: a verdict of an earlier rule is made again
VERDICTS = "projectors.json"
MAX_VERDICTS = 256            # kept in the cache file, the newest last
_BASE_S, _S_PER_MB = 60, 0.25  # the child's time limit: a real encoder on a CPU takes seconds
_REFUSED = 3                  # the child's exit status when libmtmd refuses the file cleanly
_ABORT_LINE = re.compile(r"[^\s:]+\.(?:c|cc|cpp|h):\d+: (.+)")
_IMAGE_SIDES = (48, 32)       # the child's image: small, not square


def check(model: Path, projector: Path, *, threads: int, cache_file: Path | None = None) -> None:
    """Refuse `projector` (UsageError, one line) when loading it beside `model` kills a child
    process or libmtmd refuses it; remembered in `cache_file` (default: the cache's)."""
    if cache_file is None:
        from localinfer import settings
        cache_file = settings.load().cache_dir / VERDICTS
    key = _key(model, projector)
    known = _read(cache_file)
    entry = known.get(key)
    if not (isinstance(entry, dict) and isinstance(entry.get("ok"), bool)):
        entry = _try(model, projector, threads)
        if entry.pop("keep"):
            known = _read(cache_file)     # another process may have written meanwhile
            known.pop(key, None)
            known[key] = entry
            _write(cache_file, known)
    if not entry["ok"]:
        raise UsageError(f"the projector {projector.name} {str(entry.get('reason', ''))[:300]}")


def _key(model: Path, projector: Path) -> str:
    from localinfer.backends.llama.engine import engine_version
    return "|".join([f"v{VERSION}", engine_version(), "cpu",
                     _identity(projector), _identity(model)])


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _try(model: Path, projector: Path, threads: int) -> dict:
    """The child's verdict: {"ok", "reason", "keep"} (keep: a verdict on the file, not on this
    moment; a time-out or a child that could not start says nothing about the file)."""
    limit = _BASE_S + _S_PER_MB * projector.stat().st_size / 1e6
    command = [sys.executable, "-m", __name__, str(model), str(projector),
               "--cpu", str(max(1, threads))]
    try:
        done = subprocess.run(command, capture_output=True, timeout=limit,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LocalinferError(f"trying the projector {projector.name} took more than "
                              f"{limit:.0f} s; try again on an idler machine") from None
    out = done.stdout.decode("utf-8", "replace").strip().splitlines()
    err = done.stderr.decode("utf-8", "replace")[-8192:]
    if done.returncode == 0 and out and out[-1] == "ok":
        return {"ok": True, "keep": True}
    if done.returncode == _REFUSED:
        return {"ok": False, "keep": False,
                "reason": f"was refused by llama.cpp's multimodal library: "
                          f"{out[-1] if out else 'no reason given'}"}
    if done.returncode < 0 and -done.returncode != signal.SIGKILL:
        return {"ok": False, "keep": True, "reason": _crash(-done.returncode, err)}
    if done.returncode == -signal.SIGKILL:
        raise LocalinferError(f"the process trying the projector {projector.name} was killed "
                              "(out of memory?); try again with more memory free")
    last = err.strip().splitlines()[-1] if err.strip() else f"exit status {done.returncode}"
    raise LocalinferError(f"could not try the projector {projector.name}: {last[:300]}")


def _crash(signum: int, stderr: str) -> str:
    found = [m.group(1).strip() for m in map(_ABORT_LINE.search, stderr.splitlines()) if m]
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    what = f"{name}: {found[-1]}" if found else name
    return (f"crashes llama.cpp's multimodal library as it loads or encodes ({what}); its "
            "tensors contradict its header or each other: a damaged file, or one not made for "
            "this llama.cpp")


def _read(cache_file: Path) -> dict:
    try:
        data = json.loads(cache_file.read_text("utf-8"))
    except (OSError, ValueError):
        return {}                 # absent or damaged: try again, never trust it
    return data if isinstance(data, dict) else {}


def _write(cache_file: Path, data: dict) -> None:
    kept = dict(list(data.items())[-MAX_VERDICTS:])
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(kept, indent=1), "utf-8")
        os.replace(tmp, cache_file)   # atomic: a concurrent reader sees old or new, never half
    except OSError:
        pass                          # a read-only cache only costs a child next time


# -- the child ------------------------------------------------------------------------------------
def child(model: str, projector: str, gpu: bool, threads: int) -> int:
    """Load `projector` beside `model`'s vocabulary and encode what it takes, as mtmd.py does;
    0 and "ok" on stdout, or _REFUSED and libmtmd's reason. A bad file kills this process."""
    from llama_cpp import mtmd_cpp as mtmd

    from localinfer.backends.llama.engine import engine, init_engine
    lib, log = engine(), init_engine(False)
    mtmd.mtmd_log_set(log._callback, None)
    mtmd.mtmd_helper_log_set(log._callback, None)
    mparams = lib.llama_model_default_params()
    mparams.vocab_only, mparams.n_gpu_layers = True, 0
    text_model = lib.llama_model_load_from_file(model.encode(), mparams)
    if not text_model:
        return _refused(log.last_error() or "the model's vocabulary could not be read")
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings, params.n_threads = gpu, False, threads
    ctx = mtmd.mtmd_init_from_file(projector.encode(), text_model, params)
    if not ctx:
        return _refused(log.last_error() or "it could not be loaded")
    for kind, able in (("image", mtmd.mtmd_support_vision(ctx)),
                       ("audio", mtmd.mtmd_support_audio(ctx))):
        if able and not _encode(mtmd, ctx, _bitmap(mtmd, kind)):
            return _refused(log.last_error() or f"it could not encode a small {kind}")
    print("ok", flush=True)
    return 0


def _refused(reason: str) -> int:
    print(reason.replace("\n", " ")[:300], flush=True)
    return _REFUSED


def _bitmap(mtmd, kind: str):
    if kind == "image":
        nx, ny = _IMAGE_SIDES
        pixels = bytes((7 * i) % 251 for i in range(nx * ny * 3))     # not flat: rows differ
        return mtmd.mtmd_bitmap_init(nx, ny, (ctypes.c_uint8 * len(pixels)).from_buffer_copy(
            pixels))
    samples = (ctypes.c_float * 16000)()          # one second of silence at 16 kHz
    return mtmd.mtmd_bitmap_init_from_audio(len(samples), samples)


def _encode(mtmd, ctx, bitmap) -> bool:
    """Tokenize a lone medium and encode its chunks in batches, as mtmd.Projector does."""
    marker = mtmd.mtmd_default_marker()
    text = mtmd.mtmd_input_text(marker, len(marker), False, True)
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        return False
    media = [c for c in (mtmd.mtmd_input_chunks_get(chunks, i)
                         for i in range(mtmd.mtmd_input_chunks_size(chunks)))
             if mtmd.mtmd_input_chunk_get_type(c) != 0]
    while media:
        batch = mtmd.mtmd_batch_init(ctx)
        added = 0
        for chunk in media:
            if mtmd.mtmd_batch_add_chunk(batch, chunk) != 0:
                break
            added += 1
        ok = added > 0 and mtmd.mtmd_batch_encode(batch) == 0
        mtmd.mtmd_batch_free(batch)
        if not ok:
            return False
        media = media[added:]
    return True


if __name__ == "__main__":
    sys.exit(child(sys.argv[1], sys.argv[2], sys.argv[3] == "--gpu", int(sys.argv[4])))
