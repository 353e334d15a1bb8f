"""What the command line says about GPUs: where a loaded model's layers went (`run -v`, `--json`,
`bench`), the devices the engine reports (`devices`), and how to get a GPU build when the engine
cannot use the GPU that is there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localinfer.cli import console
from localinfer.units import human_size

if TYPE_CHECKING:
    from localinfer.engine.load import LoadedModel


def offload_facts(loaded: LoadedModel) -> dict:
    """{"offload": {gpu_layers, cpu_layers, layers, gpu_devices}} for a llama.cpp session; empty
    for a backend that does not split layers (MLX runs wholly on its device)."""
    offload = getattr(loaded.session, "offload", None)
    return {"offload": offload.as_dict()} if offload is not None else {}


def offload_line(loaded: LoadedModel) -> str | None:
    """`12 of 33 layers on the GPU (CUDA0 (...)), 21 on the CPU`, for -v."""
    offload = getattr(loaded.session, "offload", None)
    if offload is None:
        return None
    if offload.remote:
        placed = ", ".join(f"{n} on {d}" for d, n in zip(offload.devices, offload.shares))
        return f"layers: {placed}, {offload.layers - offload.gpu_layers} on the CPU"
    where = f" ({', '.join(offload.devices)})" if offload.devices else \
        " (this llama.cpp build has no GPU backend)" if offload.no_gpu else ""
    # Experts kept in RAM are news only beside layers on a GPU: on a CPU everything is there.
    experts = (f"; experts of {offload.cpu_moe} of {offload.layers - 1} layers in RAM "
               f"(--cpu-moe)" if offload.cpu_moe and offload.gpu_layers else "")
    return (f"layers: {offload.gpu_layers} of {offload.layers} on the GPU{where}, "
            f"{offload.layers - offload.gpu_layers} on the CPU{experts}")


def placement_text(placement, n_layer: int) -> str:
    """Where `run` would put a model here (fit.rules.Placement), for `info`."""
    if placement.spread:
        fits = "" if placement.fits else f"; does not fit: {placement.overfull or 'the RAM'}"
        return f"{placement.spread} (context {placement.n_ctx}, {placement.kv_type} KV cache){fits}"
    text = (f"{placement.gpu_layers} of {placement.layers} layers on the GPU"
            if placement.gpu_layers else f"all {placement.layers} layers on the CPU")
    if placement.cpu_moe and placement.gpu_layers:
        text += f", experts of {placement.cpu_moe} of {n_layer} layers in RAM"
    fits = "" if placement.fits else "; does not fit the memory budget"
    return f"{text} (context {placement.n_ctx}, {placement.kv_type} KV cache){fits}"


def say_offload(loaded: LoadedModel) -> None:
    """The -v lines: where the layers went, and how to get a GPU build when one would help."""
    line = offload_line(loaded)
    if line:
        console.note(line)
        say_rebuild_hint()


def say_rebuild_hint(hint: str | None = None) -> None:
    """One warning line with the command that rebuilds llama.cpp for the GPU that is here, when
    the engine cannot use it (`hint`: already worked out, "" for none; None: work it out)."""
    if hint is None:
        from localinfer.fit import gpu
        hint = gpu.this_rebuild_hint()
    if hint:
        console.warn(hint)


def device_rows(devices: list[dict]) -> list[list[str]]:
    """`devices` table rows, one per engine device: its type and free/total memory."""
    rows = []
    for d in devices:
        memory = (f"{human_size(d['memory_free'])} free of {human_size(d['memory_total'])}"
                  if d["memory_total"] else "memory not reported")
        if d["kind"] == "cpu":
            memory = f"system RAM, {human_size(d['memory_total'])}"   # ggml's "free" is the total
        label = d["description"] or d["name"]
        rows.append([f"device {d['name']}", f"{d['kind']} · {label} · {memory}"])
    return rows
