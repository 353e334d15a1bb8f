"""`pull`, `list`, `rm`, `info` and `devices`: the models in the store and the machine they run on."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from localinfer.cli import console
from localinfer.cli.options import json_option, model_argument, rpc_option
from localinfer.errors import UsageError
from localinfer.models import hub, refs
from localinfer.units import human_size


def register(app: typer.Typer) -> None:
    app.command()(pull)
    app.command("list")(list_models)
    app.command()(rm)
    app.command()(info)
    app.command()(devices)


def pull(model: str = model_argument("Catalogue name or alias[:QUANT], hf:OWNER/REPO[:QUANT] "
                                      "or hf:OWNER/REPO/FILE.gguf.")) -> None:
    """Download a model into the store (tries each source in order).

    \b
    localinfer pull gemma3-270m
    localinfer pull hf:OWNER/REPO:Q4_K_M
    """
    from localinfer.fit import auto
    from localinfer.fit.rules import MIN_CTX
    from localinfer.models import fetch, hub
    from localinfer.speculate import choose
    _, cat, store = refs.context()
    if hub.is_hub_ref(model):       # the repository's listing is taken again
        spec, quant = hub.resolve(model, store, offline=False, refresh=True, notify=console.note)
        ref = refs.variant_ref(spec, quant, store)
    else:
        ref = refs.parse_ref(model, cat)
    if ref.spec is None:
        raise UsageError("pull takes a catalogue name, not a file path")
    path = fetch.ensure(ref.spec, ref.spec.variant(ref.quant), store,
                        progress=console.interactive(), notify=console.note,
                        download_bar=lambda total: console.byte_bar(ref.display, total))
    console.note(f"{ref.display} is at {path}")
    # The probe a first run would make, made now: the model is on disk, the user is waiting anyway.
    choose.probe_ahead(path, ref.display, place=lambda p: auto.place_file(p, n_ctx=MIN_CTX),
                       notify=console.note, warn=console.warn)


def list_models(
    catalogue_: bool = typer.Option(False, "--catalogue", help="All models that can be pulled."),
) -> None:
    """Models on disk (or the whole catalogue with --catalogue).

    \b
    localinfer list
    localinfer list --catalogue
    """
    _, cat, store = refs.context()
    if catalogue_:
        rows = [[spec.name, ", ".join(spec.variants), spec.parameters, spec.kind,
                 ", ".join(spec.aliases)] for spec in cat.models.values()]
        console.print_table(["NAME", "QUANTS", "PARAMS", "KIND", "ALIASES"], rows)
        return
    rows = [[hub.stored_name(store, m.name), m.quant, human_size(m.size), str(m.path)]
            for m in store.installed()]
    if not rows:
        console.note("no models on disk yet; `localinfer pull NAME` or `localinfer list --catalogue`")
        return
    console.print_table(["NAME", "QUANT", "SIZE", "PATH"], rows)


def rm(model: str = typer.Argument(..., metavar="MODEL", show_default=False,
                                   help="NAME (every quant) or NAME:QUANT; hf:OWNER/REPO"
                                   "[:QUANT] for a model from the Hub.")) -> None:
    """Delete a model from the store.

    \b
    localinfer rm gemma-3-270m
    localinfer rm smollm2:Q3_K_S
    """
    from localinfer.models import hub, store_sweep
    _, cat, store = refs.context()
    if hub.is_hub_ref(model):
        stored_name, quant = _hub_target(model, store)
    else:
        name, _, quant = model.partition(":")
        spec = cat.get(name)
        stored_name = spec.name if spec else name
    store_sweep.sweep(store)        # temporary files that killed writers left go too
    removed = store.remove(stored_name, quant.upper() or None)
    if not quant:                   # the whole model: its Hub listing goes with it
        removed += hub.remove_listing(store, stored_name)
    if not removed:
        raise UsageError(f"{model} is not on disk (`localinfer list` shows what is)")
    for path in removed:
        console.note(f"removed {path}")


def _hub_target(model: str, store) -> tuple[str, str]:
    """The store folder and quant tag (or '') an `hf:` reference names, without asking the Hub."""
    from localinfer.models import hub
    ref = hub.parse(model)
    if ref.file is None:
        return hub.store_name(ref.repo), ref.quant or ""
    _, quant = hub.resolve(model, store, offline=True)
    return hub.store_name(ref.repo), quant


def info(
    model: str = model_argument(),
    as_json: bool = json_option(),
    rpc: Optional[str] = rpc_option(),
) -> None:
    """Facts about a model: architecture, size, layers, heads, vocabulary, tensor types.

    \b
    localinfer info gemma-3-270m
    localinfer info model.gguf --json
    """
    from localinfer.cli import info as model_info
    from localinfer.routing import lookup
    if (router := lookup(model)) is not None:       # a router's policy and models
        return model_info.show(model_info.router_facts(router), as_json=as_json)
    _, cat, store = refs.context()
    facts = model_info.describe(refs.parse_ref(model, cat), store)
    model_info.show(facts, as_json=as_json)


def devices(as_json: bool = json_option(), rpc: Optional[str] = rpc_option()) -> None:
    """This machine's CPU, memory and accelerators, and the backend `run` would choose.

    Each device llama.cpp and ONNX Runtime report, with its free and total memory.

    \b
    localinfer devices
    localinfer devices --json
    """
    from localinfer.fit import machine
    _show_devices(machine.detect(), as_json=as_json)


def _onnx_device_rows(onnx: dict) -> list[list[str]]:
    """ONNX Runtime's devices and plugin libraries, each with whether `auto` would use it."""
    rows = [[f"onnx {d['type']}", f"{d['provider']}{' · ' + d['vendor'] if d['vendor'] else ''}"
                                  f" · {d['auto']}"] for d in onnx.get("devices", [])]
    rows += [["onnx plugin", f"{name}: {problem or 'registered'}"]
             for name, problem in onnx.get("plugins", {}).items()]
    return rows


def _show_devices(facts: dict, *, as_json: bool) -> None:
    from localinfer.cli.gpu import device_rows, say_rebuild_hint
    if as_json:
        sys.stdout.write(json.dumps(facts, indent=2) + "\n")
        say_rebuild_hint(facts.get("gpu_hint") or "")
        return
    rows = [
        ["cpu", f"{facts['cpu']} ({facts['machine']})"],
        ["cores", f"{facts['physical_cores']} physical, {facts['logical_cores']} logical"],
        ["simd", " ".join(facts["simd"]) or "none detected"],
        ["ram", f"{human_size(facts['ram_available'])} available of "
                f"{human_size(facts['ram_total'])}"],
        ["apple silicon", "yes (Metal)" if facts["apple_silicon"] else "no"],
        ["onnxruntime", ", ".join(facts["onnxruntime_providers"])
         if facts["onnxruntime_providers"] is not None else "not installed"],
    ]
    for name, entry in facts["backends"].items():
        if not entry["available"]:
            rows.append([f"backend {name}", "not installed"])
            continue
        gpu = "GPU offload" if entry.get("gpu_offload") else "CPU only (no GPU offload in this build)"
        if name == "mlx":
            gpu = "Metal" if entry.get("metal") else "CPU build (no Metal)"
            gpu += f"; runs {', '.join(entry.get('architectures', []))}"
        rows.append([f"backend {name}", f"{entry.get('version', '')}, {gpu}"])
    rows += _onnx_device_rows(facts["backends"].get("onnx", {}))
    rows += device_rows(facts.get("devices", []))
    if facts.get("placement"):
        rows.append(["placement", facts["placement"]])
    if facts.get("engine_tuning"):
        rows.append(["engine tuning", facts["engine_tuning"]])
    rpc = facts.get("rpc") or {}
    if rpc:
        rows.append(["rpc workers", "yes (localinfer worker, --rpc)" if rpc["supported"]
                     else rpc["hint"] or "no"])
    use = facts["run_would_use"]
    rows.append(["run would use", f"{use['backend']}: {use['reason']}"])
    console.print_table(["DEVICE", "VALUE"], rows)
    say_rebuild_hint(facts.get("gpu_hint") or "")
