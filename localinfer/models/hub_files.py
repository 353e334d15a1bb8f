"""From the files a Hub repository lists to the quant variants of a model (models.hub takes the
listing; this module only reads file names and the sizes and hashes beside them).

A repository of GGUF files usually holds one model in several quantizations, each a file whose
name ends in its quant (`SmolLM2-135M-Instruct-Q4_K_M.gguf`), a large one split in parts
(`…-Q8_0-00001-of-00003.gguf`), sometimes in a folder per quant. Names come from the Hub and are
hostile: a name that is not a plain relative path of ordinary characters is left out, and none of
them ever becomes a path in the store (which names files by model and quant tag only).
"""

from __future__ import annotations

import re

from localinfer.models.catalogue import HubFile, HubSource, ModelSpec, Variant, normalise_quant
from localinfer.gguf.split import SPLIT_NAME
from localinfer.models.store import PROJECTOR, is_safe_name, to_safe_name

# A quant type in a file name: Q4_K_M, Q8_0, IQ4_XS, TQ1_0, F16, BF16, F32, MXFP4, and the like,
# between separators. The last one in the name wins (`Llama-3-8B-Q4_K_M`: not the 3 or 8B).
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[A-Za-z0-9]{1,4}){0,3}|TQ[12]_0|B?F16|F32|"
                    r"MXFP4)(?![A-Za-z0-9])", re.IGNORECASE)
# GGUF files that are not a language model on their own: vision projectors, importance matrices.
_NOT_A_MODEL = re.compile(r"mmproj|imatrix", re.IGNORECASE)
_COMPONENT = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,199}")
MAX_PATH = 1000
# The quant pulled first when none is named and nothing is on disk (auto-fit then picks among all
# the listed sizes): the usual default of GGUF repositories, then what is near it.
PREFERRED = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q4_0", "Q4_1", "Q5_K_S", "Q6_K", "Q8_0")
# The projector pulled with a multimodal model: full precision first (what llama.cpp's own
# repositories publish as the reference), then the quantized ones.
PROJECTOR_PREFERRED = ("F16", "BF16", "Q8_0", "F32")


def is_plain_path(path: object) -> bool:
    """Whether a file name from the Hub is a relative path of ordinary components: no '..', no
    absolute or hidden part, no backslash or control character, so that huggingface_hub's
    download of it stays inside the folder it downloads into."""
    if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH:
        return False
    return all(_COMPONENT.fullmatch(part) and part != ".." for part in path.split("/"))


def quant_of(stem: str) -> str | None:
    """The quant type a file's name (without `.gguf` and a split suffix) ends with, if any."""
    found = _QUANT.findall(stem)
    return normalise_quant(found[-1]) if found else None


def model_files(files: list[HubFile]) -> list[tuple[str, tuple[HubFile, ...]]]:
    """Each model among the files, as (its stem, its files in order): a whole file alone, a split
    model's parts only when every part of it is listed. Non-models and odd names are left out."""
    whole: list[tuple[str, tuple[HubFile, ...]]] = []
    splits: dict[tuple[str, int], dict[int, HubFile]] = {}
    for f in files:
        base = f.path.rsplit("/", 1)[-1]
        if not is_plain_path(f.path) or not base.lower().endswith(".gguf") or \
                _NOT_A_MODEL.search(base):
            continue
        split = SPLIT_NAME.fullmatch(f.path)
        if split is None:
            whole.append((base[:-5], (f,)))
        elif 0 < int(split["no"]) <= int(split["count"]):
            splits.setdefault((split["prefix"], int(split["count"])), {})[int(split["no"])] = f
    for (prefix, count), parts in splits.items():
        if len(parts) == count:
            whole.append((prefix.rsplit("/", 1)[-1], tuple(parts[k] for k in range(1, count + 1))))
    return sorted(whole, key=lambda m: m[1][0].path)


def variants(files: list[HubFile]) -> dict[str, tuple[HubFile, ...]]:
    """Quant tag -> the files of that variant. A tag is the quant in the file name; where two
    models in the repository have the same quant (or a name has none), each is tagged by its
    file's stem instead, made a safe name. Tags that are still not unique are left out."""
    models = model_files(files)
    by_quant: dict[str | None, int] = {}
    for stem, _ in models:
        by_quant[quant_of(stem)] = by_quant.get(quant_of(stem), 0) + 1
    out: dict[str, tuple[HubFile, ...]] = {}
    for stem, parts in models:
        quant = quant_of(stem)
        tag = quant if quant and by_quant[quant] == 1 else normalise_quant(to_safe_name(stem))
        if is_safe_name(tag) and tag not in out:
            out[tag] = parts
    return out


def default_quant(found: dict[str, tuple[HubFile, ...]]) -> str:
    preferred = next((q for q in PREFERRED if q in found), None)
    return preferred or min(found, key=lambda q: sum(f.size for f in found[q]))


def spec(name: str, repo: str, revision: str, files: list[HubFile]) -> ModelSpec:
    """The model a repository listing describes, as the catalogue would: one variant per quant,
    its size (all parts) and sha256 from the listing, its source the repository at `revision`."""
    found = variants(files)
    listing = f"the listing of hf:{repo}"
    out = {}
    for quant, parts in found.items():
        source = HubSource(repo=repo, file=parts[0].path, revision=revision,
                           parts=parts if len(parts) > 1 else ())
        out[quant] = Variant(quant=quant, size=sum(f.size for f in parts),
                             sha256=parts[0].sha256 if len(parts) == 1 else None,
                             sources=(source,), defined_in=listing)
    return ModelSpec(name=name, aliases=(), family="", architecture="", parameters="",
                     context_length=0, kind="", license="",
                     default_quant=default_quant(found) if found else "", draft="",
                     description=f"hf:{repo}", variants=out, hub_repo=repo,
                     projector=_projector(files, repo, revision, listing))


def projector_file(files: list[HubFile]) -> HubFile | None:
    """The repository's mmproj file, when it has one (whole, a plain name): F16 before the
    quantized ones, then the smallest."""
    found = [f for f in files if is_plain_path(f.path) and f.path.lower().endswith(".gguf")
             and "mmproj" in f.path.rsplit("/", 1)[-1].lower() and not SPLIT_NAME.fullmatch(f.path)]
    if not found:
        return None
    rank = {q: k for k, q in enumerate(PROJECTOR_PREFERRED)}
    return min(found, key=lambda f: (rank.get(quant_of(f.path[:-5]) or "", len(rank)), f.size,
                                     f.path))


def _projector(files: list[HubFile], repo: str, revision: str, listing: str) -> Variant | None:
    chosen = projector_file(files)
    if chosen is None:
        return None
    return Variant(quant=PROJECTOR, size=chosen.size, sha256=chosen.sha256,
                   sources=(HubSource(repo=repo, file=chosen.path, revision=revision),),
                   defined_in=listing)
