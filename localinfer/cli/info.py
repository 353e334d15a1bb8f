"""`localinfer info`: what a model is, read from its GGUF header (or the catalogue if not pulled)."""

from __future__ import annotations

import json
import sys
from collections import Counter

from localinfer.cli import console
from localinfer.gguf import split as gguf_split
from localinfer.gguf.checks import check_model
from localinfer.gguf.header import ArrayInfo
from localinfer.models.refs import ModelRef
from localinfer.models.store import Store
from localinfer.units import human_size


def describe(ref: ModelRef, store: Store) -> dict:
    path = ref.path or store.find(ref.spec.name, ref.quant)
    facts: dict = {"model": ref.display}
    if ref.spec is not None and ref.spec.hub_repo:     # from a Hub listing: its files' facts
        spec = ref.spec
        facts.update(hub_repository=spec.hub_repo, store_name=spec.name,
                     quants=list(spec.variants),
                     sizes={q: v.size for q, v in spec.variants.items()})
        if path is None:
            facts.update(on_disk=False, **_planned_projector(spec))
            return facts
    elif ref.spec is not None:
        spec = ref.spec
        facts.update(catalogue_name=spec.name, family=spec.family, kind=spec.kind,
                     license=spec.license, quants=list(spec.variants), draft=spec.draft or None)
    if path is None:
        facts.update(on_disk=False, architecture=ref.spec.architecture,
                     parameters=ref.spec.parameters, context_length=ref.spec.context_length,
                     **_planned_projector(ref.spec))
        return facts
    facts.update(on_disk=True, path=str(path))
    facts.update(_from_header(path))
    facts["memory"] = memory_table(path)
    facts.update(projector_here(path) or _planned_projector(ref.spec))
    facts["placement"] = placement_here(path)
    return facts


def projector_here(path) -> dict:
    """The projector beside the model file, what libmtmd reads of it (the whole file) and its
    encoder's compute for one image or clip: what `run --image` adds to the memory above."""
    from localinfer.fit.projector import projector_bytes
    from localinfer.models.projector import beside
    found = beside(path)
    if found is None:
        return {}
    from localinfer.errors import LocalinferError
    size = found.stat().st_size
    try:
        compute = projector_bytes(found) - size
    except LocalinferError:         # not a readable projector: `run --image` says so
        compute = None
    return {"projector": str(found), "projector_size": size, "projector_compute": compute}


def _planned_projector(spec) -> dict:
    """A model not on disk: its projector's recorded or listed size (no Hub is asked here)."""
    if spec is None or spec.projector is None:
        return {}
    return {"projector_size": spec.projector.size}


def placement_here(path) -> str | None:
    """Where `run` would put the model's layers (and a mixture's experts) on this machine."""
    from localinfer.cli.gpu import placement_text
    from localinfer.errors import LocalinferError
    from localinfer.fit import auto, memory
    try:
        return placement_text(auto.place_file(path, n_ctx=0),
                              memory.facts_from_file(path).n_layer)
    except LocalinferError:
        return None


MEMORY_CONTEXTS = (512, 2048, 4096, 8192)


def memory_table(path) -> dict[str, dict[str, int]]:
    """Estimated resident memory of `localinfer run` at a few context lengths (f16 KV cache)."""
    from localinfer.fit import memory
    facts = memory.facts_from_file(path)
    repack = memory.cpu_repacks()
    return {str(ctx): memory.estimate(facts, memory.Request(ctx, repack=repack)).as_dict()
            for ctx in MEMORY_CONTEXTS}


def _from_header(path) -> dict:
    # A damaged file is reported as such, not described; a split model counts all its parts.
    header, size = gguf_split.whole_model(path, check_model(path))
    meta = header.metadata
    arch = str(meta.get("general.architecture", "unknown"))

    def arch_key(name: str):
        return meta.get(f"{arch}.{name}")

    tokens = meta.get("tokenizer.ggml.tokens")
    type_bytes: Counter[str] = Counter()
    type_count: Counter[str] = Counter()
    for t in header.tensors:
        type_bytes[t.type_name] += t.n_bytes
        type_count[t.type_name] += 1
    return {
        "file_size": size,
        **({"parts": gguf_split.split_count(header)} if gguf_split.split_count(header) > 1 else {}),
        "architecture": arch,
        "name": meta.get("general.name"),
        "parameters": sum(t.n_elements for t in header.tensors),
        "layers": arch_key("block_count"),
        "heads": arch_key("attention.head_count"),
        "kv_heads": arch_key("attention.head_count_kv"),
        "embedding_length": arch_key("embedding_length"),
        "context_length": arch_key("context_length"),
        "sliding_window": arch_key("attention.sliding_window"),
        **_experts(header, arch_key("block_count") or 0, arch_key),
        "vocab_size": tokens.length if isinstance(tokens, ArrayInfo) else len(tokens or []),
        "tensor_types": {name: {"tensors": type_count[name], "bytes": size}
                         for name, size in type_bytes.most_common()},
        "chat_template": "tokenizer.chat_template" in meta,
        "gguf_version": header.version,
    }


def _experts(header, n_layer: int, arch_key) -> dict:
    """A mixture of experts' counts and the bytes of its expert tensors (fit.moe places them)."""
    from localinfer.fit.moe import expert_bytes
    n_expert = arch_key("expert_count")
    if not n_expert:
        return {}
    return {"experts": n_expert, "experts_used": arch_key("expert_used_count"),
            "expert_tensor_bytes": sum(expert_bytes(header.tensors, int(n_layer)))}


def show(facts: dict, *, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(facts, indent=2) + "\n")
        return
    rows = []
    for key, value in facts.items():
        if value is None:
            continue
        if key == "memory":
            rows.extend(_memory_rows(value))
            continue
        if key == "tensor_types":
            total = sum(v["bytes"] for v in value.values()) or 1
            value = ", ".join(f"{k} {v['bytes'] / total:.0%} ({v['tensors']})" for k, v in value.items())
        elif key in ("file_size", "expert_tensor_bytes", "projector_size", "projector_compute"):
            value = human_size(value)
        elif key == "sizes":
            value = ", ".join(f"{q} {human_size(n)}" for q, n in value.items())
        elif key == "parameters" and isinstance(value, int):
            value = f"{value / 1e6:.1f}M" if value < 1e9 else f"{value / 1e9:.2f}B"
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        rows.append([key.replace("_", " "), str(value)])
    console.print_table(["FIELD", "VALUE"], rows)


def _memory_rows(table: dict[str, dict[str, int]]) -> list[list[str]]:
    mb = lambda n: f"{n / 1e6:.0f}"   # noqa: E731 - a local formatter
    return [[f"memory at ctx {ctx}",
             f"{human_size(e['total'])} (weights {mb(e['weights'])} + KV {mb(e['kv_cache'])}"
             f" + compute {mb(e['compute'])} + overhead {mb(e['overhead'])} MB)"]
            for ctx, e in table.items()]


def router_facts(router) -> dict:
    """What `info ROUTER` and `show ROUTER` print of a router (routing.Router): its policy,
    models and decision, as config.toml declares them."""
    import math
    from localinfer.routing import Cascade
    facts: dict = {"router": router.name, "declared_in": f"{router.path} [routers.{router.name}]",
                   "policy": router.kind, "models": list(router.models)}
    policy = router.policy
    if isinstance(policy, Cascade):
        finite = math.isfinite(policy.threshold)
        return facts | {"decides_after_tokens": policy.tokens, "confidence": policy.measure,
                        "threshold": policy.threshold if finite else str(policy.threshold)}
    return facts | {"rules": [line for _, line in router.describe() if "->" in line],
                    "otherwise": policy.default}
