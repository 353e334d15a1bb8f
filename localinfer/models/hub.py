"""`hf:OWNER/REPO[:QUANT]` and `hf:OWNER/REPO/FILE.gguf`: any GGUF repository on the Hugging Face
Hub as a model, as the catalogue's are (docs/hub.md).

The repository's listing (each file's size and LFS sha256, at one commit) is taken once through
huggingface_hub and kept in the model's store folder, so that `run`, `info`, `rm` and `--offline`
work without the Hub; `pull` takes it again. From the listing comes a ModelSpec (models.hub_files)
whose variants fetch, auto-fit and the store handle as they handle the catalogue's. The endpoint
is huggingface_hub's own (HF_ENDPOINT moves it).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from localinfer.errors import FetchError, LocalinferError, ModelLoadError, UsageError
from localinfer.models import fetch, hub_files
from localinfer.models.catalogue import HubFile, HubSource, ModelSpec, normalise_quant
from localinfer.gguf.header import CorruptFile, Header, parse_start
from localinfer.models.store import Store, check_name, is_safe_name, publish, temp_path

PREFIX = "hf:"
LISTING = "hub-listing.json"
FORM = "hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf"
# The Hub's own rule for owner and repository names (huggingface_hub validate_repo_id): letters,
# digits, '-', '_', '.', no '--' or '..', at most 96 characters.
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_LISTING_BYTES = 8 << 20       # a saved listing read back: a repository of 10,000 files fits
MAX_FILES = 10_000
MAX_FILE_SIZE = 1 << 50


@dataclass(frozen=True)
class HubRef:
    repo: str                  # OWNER/REPO as typed
    quant: str | None = None   # :QUANT, normalised
    file: str | None = None    # /FILE.gguf: one file of the repository

    @property
    def names_variant(self) -> bool:
        return self.quant is not None or self.file is not None


@dataclass(frozen=True)
class Listing:
    repo: str
    revision: str              # the commit the listing describes; files are fetched at it
    files: tuple[HubFile, ...]


def is_hub_ref(text: str) -> bool:
    return text.strip().lower().startswith(PREFIX)


def parse(text: str) -> HubRef:
    """What an `hf:` reference names; a UsageError (exit 2) for a malformed one."""
    body = text.strip()[len(PREFIX):]
    owner, _, rest = body.partition("/")
    if "/" in rest:
        repo, _, file = rest.partition("/")
        if not hub_files.is_plain_path(file) or not file.lower().endswith(".gguf"):
            raise _malformed(text, f"{file!r} is not a plain .gguf file name")
        return HubRef(_repo(text, owner, repo), file=file)
    repo, _, quant = rest.partition(":")
    if quant:
        check_name(normalise_quant(quant), "quant tag")
    return HubRef(_repo(text, owner, repo), quant=normalise_quant(quant) if quant else None)


def _repo(text: str, owner: str, repo: str) -> str:
    for part in (owner, repo):
        if not _PART.fullmatch(part) or "--" in part or ".." in part:
            raise _malformed(text, f"{part!r} is not an owner or repository name (letters, "
                                   "digits, '-', '_', '.')" if part else "OWNER/REPO is missing")
    return f"{owner}/{repo}"


def _malformed(text: str, why: str) -> UsageError:
    return UsageError(f"{text.strip()!r} is not a Hub reference: {why}; use {FORM}")


def store_name(repo: str) -> str:
    """The model's folder name in the store: `hf--owner--repo`, lower case (the Hub's names are
    case-insensitive, and '--' is in no Hub name, so two repositories never share one); a long
    one is cut and ends in a hash of the whole."""
    name = "hf--" + repo.lower().replace("/", "--")
    if not is_safe_name(name):
        name = name[:71] + "-" + hashlib.sha256(repo.lower().encode()).hexdigest()[:8]
    return check_name(name)


def resolve(text: str, store: Store, *, offline: bool, refresh: bool = False,
            notify: fetch.Notify = lambda _: None) -> tuple[ModelSpec, str]:
    """The model an `hf:` reference names and the quant to use (its default when none is named):
    from the listing kept on disk, else (or with `refresh`, or for a quant the kept listing
    lacks) from the Hub."""
    ref = parse(text)
    name = store_name(ref.repo)
    listing = None if refresh else load_listing(store, name, ref.repo, notify)
    if listing is not None and not offline and not _has(listing, name, ref, store):
        listing = None            # a quant or file added since: ask the Hub again
    if listing is None:
        if offline:
            raise FetchError(f"hf:{ref.repo} is not on disk and --offline forbids asking the Hub "
                             "for its files")
        listing = fetch_listing(ref.repo)
        save_listing(store, name, listing)
    spec = hub_files.spec(name, listing.repo, listing.revision, list(listing.files))
    return spec, _chosen(spec, ref, store)


def _has(listing: Listing, name: str, ref: HubRef, store: Store) -> bool:
    spec = hub_files.spec(name, listing.repo, listing.revision, list(listing.files))
    try:
        _chosen(spec, ref, store)
    except LocalinferError:
        return False
    return True


def _chosen(spec: ModelSpec, ref: HubRef, store: Store) -> str:
    """The quant tag the reference names: one the listing has, or one made here (`quantize`)."""
    if ref.quant and ref.quant not in spec.variants and store.find(spec.name, ref.quant):
        return ref.quant
    if not spec.variants:
        raise FetchError(f"hf:{ref.repo} has no GGUF model file")
    if ref.file is not None:
        for quant, variant in spec.variants.items():
            parts = variant.sources[0].parts or (HubFile(variant.sources[0].file, 0, None),)
            if ref.file in (p.path for p in parts):
                return quant
        raise FetchError(f"hf:{ref.repo} has no model file {ref.file}; its GGUF files: "
                         + ", ".join(v.sources[0].file for v in spec.variants.values()))
    quant = ref.quant or spec.default_quant
    if quant not in spec.variants:
        raise FetchError(f"hf:{ref.repo} has no file for quant {quant}; it has "
                         + ", ".join(spec.variants))
    return quant


# -- the listing, from the Hub ---------------------------------------------------------------------
def fetch_listing(repo: str) -> Listing:
    """Every file of the repository with its size and sha256, at its latest commit."""
    import huggingface_hub
    from huggingface_hub.utils import logging
    logging.set_verbosity_error()
    fetch.check_hub_reachable(huggingface_hub.constants.ENDPOINT)
    try:
        info = huggingface_hub.HfApi().model_info(repo, files_metadata=True)
    except Exception as e:  # huggingface_hub raises many types; the user needs the reason only
        raise FetchError(f"hf:{repo}: {fetch.hub_reason(e)}") from e
    files = []
    for sibling in info.siblings or []:
        sha = sibling.lfs.sha256 if sibling.lfs else None
        files.append(HubFile(sibling.rfilename, sibling.size, sha))
    # The Hub's own spelling of the name when it answers for another case of it.
    canonical = info.id if isinstance(info.id, str) and info.id.lower() == repo.lower() else repo
    listing = _checked({"repo": canonical, "revision": info.sha,
                        "files": [f.__dict__ for f in files]}, repo)
    if listing is None:
        raise FetchError(f"hf:{repo}: the Hub's answer is not a listing this version understands")
    return listing


# -- a file's header, read from the Hub -----------------------------------------------------------
MAX_REMOTE_HEADER = 64 << 20      # Gemma 3's 262k-token vocabulary takes 4 MB of a header


def remote_header(spec: ModelSpec, quant: str) -> tuple[Header, int]:
    """The GGUF header at the start of a variant's (first) file, and that file's size, read with
    range requests of growing length (a few MB) instead of the download: what auto-fit needs to
    choose a quant before pulling any. Checked as a file on disk would be (gguf/checks.py)."""
    from localinfer.gguf.checks import check_hparams
    source = spec.variants[quant].sources[0]
    size = source.parts[0].size if source.parts else spec.variants[quant].size
    header = remote_file_header(source, size)
    try:
        check_hparams(header.metadata)
    except CorruptFile as e:
        raise ModelLoadError(f"{source.file}: {e}") from None
    return header, size


def remote_file_header(source: HubSource, size: int | None) -> Header:
    """The GGUF header of the Hub file `source` of `size` bytes (a model's or a projector's;
    None: not known, the tensors then say), its tensors checked, from its first bytes (a few MB)."""
    from localinfer.gguf.header import check_tensors
    if not isinstance(source, HubSource):
        raise LocalinferError(f"{source.describe()} is not a file on the Hub")
    size = size or MAX_FILE_SIZE
    n = 2 << 20
    while True:
        header = parse_start(_first_bytes(source, min(n, size)), size, source.file)
        if header is not None:
            break
        if n >= min(size, MAX_REMOTE_HEADER):
            raise ModelLoadError(f"{source.file}: no GGUF header in its first {n >> 20} MB")
        n *= 4
    try:
        check_tensors(header)
    except CorruptFile as e:
        raise ModelLoadError(f"{source.file}: {e}") from None
    return header


def _first_bytes(source: HubSource, n: int) -> bytes:
    """At most `n` bytes from the start of a file: streamed, so a server that ignores the range
    costs no more than `n` bytes."""
    import huggingface_hub
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    url = huggingface_hub.hf_hub_url(source.repo, source.file, revision=source.revision)
    headers = {**build_hf_headers(), "Range": f"bytes=0-{n - 1}", "Accept-Encoding": "identity"}
    got = bytearray()
    try:
        with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=30) as response:
            hf_raise_for_status(response)
            for chunk in response.iter_bytes():
                got += chunk
                if len(got) >= n:
                    break
    except Exception as e:  # huggingface_hub and httpx raise many types
        raise FetchError(f"hf:{source.repo}: {fetch.hub_reason(e)}") from e
    return bytes(got[:n])


# -- the listing, on disk --------------------------------------------------------------------------
def listing_path(store: Store, name: str) -> Path:
    return store.path_for(name, "LISTING").parent / LISTING


def save_listing(store: Store, name: str, listing: Listing) -> None:
    """Written to a temporary file and renamed: a reader sees the old listing or the new one."""
    final = listing_path(store, name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    data = {"repo": listing.repo, "revision": listing.revision,
            "files": [f.__dict__ for f in listing.files]}
    try:
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LocalinferError(f"cannot write {final}: {e.strerror}") from e
    publish(tmp, final)


def load_listing(store: Store, name: str, repo: str | None,
                 notify: fetch.Notify = lambda _: None) -> Listing | None:
    """The listing kept for a model folder, checked as hostile input; None when there is none or
    it is not a valid listing of `repo` (any repository when None)."""
    path = listing_path(store, name)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_LISTING_BYTES + 1)
    except OSError:
        return None
    listing = None
    if len(raw) <= MAX_LISTING_BYTES:
        try:
            listing = _checked(json.loads(raw.decode("utf-8")), repo)
        except (UnicodeDecodeError, ValueError, RecursionError):
            listing = None
    if listing is None or store_name(listing.repo) != name:
        notify(f"{path} is not a valid listing; not using it")
        return None
    return listing


def _checked(data: object, repo: str | None) -> Listing | None:
    """A listing from JSON whose every field has the shape it must have; None otherwise."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), list) or \
            len(data["files"]) > MAX_FILES:
        return None
    got, revision = data.get("repo"), data.get("revision")
    if not isinstance(got, str) or (repo is not None and got.lower() != repo.lower()):
        return None
    try:
        parse(PREFIX + got)
    except UsageError:
        return None
    if not isinstance(revision, str) or not _COMMIT.fullmatch(revision):
        return None
    files = []
    for f in data["files"]:
        if not isinstance(f, dict):
            return None
        path, size, sha = f.get("path"), f.get("size"), f.get("sha256")
        if not isinstance(path, str) or type(size) is not int or not 0 <= size < MAX_FILE_SIZE \
                or not (sha is None or isinstance(sha, str) and _SHA256.fullmatch(sha)):
            return None
        files.append(HubFile(path, size, sha))    # odd paths are left out later (hub_files)
    return Listing(got, revision, tuple(files))


def remove_listing(store: Store, name: str) -> list[Path]:
    """Delete a model folder's listing (with the model's last file); what was deleted."""
    if not name.startswith("hf--") or (store.root / name).is_symlink():
        return []
    path = listing_path(store, name)
    if not path.is_file():
        return []
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()        # only when empty
    except OSError:
        pass
    return [path]


def stored_name(store: Store, name: str) -> str:
    """A store folder's name as a user types it: `hf:OWNER/REPO` for a model from the Hub."""
    repo = stored_repo(store, name)
    return f"hf:{repo}" if repo else name


def stored_repo(store: Store, name: str) -> str | None:
    """OWNER/REPO of a store folder made for an `hf:` model, from its listing; None otherwise."""
    if not name.startswith("hf--"):
        return None
    listing = load_listing(store, name, None)
    return listing.repo if listing else None
