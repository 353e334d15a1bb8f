"""What this machine offers (CPU, SIMD, memory, backends) and which backend `run` would pick, and
why: the `devices` report. The OS and CPU are asked in one place, `localinfer.machine`."""

from __future__ import annotations

from localinfer import backends, machine

# SIMD extensions that decide llama.cpp's kernel speed, as /proc/cpuinfo names them.
_SIMD_FLAGS = ("sse3", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f",
               "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "asimd",
               "asimddp", "sve", "sve2", "i8mm")


def detect() -> dict:
    cpu_name, flags = machine.cpu()
    physical, logical = machine.machine_cores()
    ram_total, ram_available = machine.ram()
    facts = {
        "os": machine.os_name(),
        "machine": machine.arch(),
        "cpu": cpu_name,
        "physical_cores": physical,
        "logical_cores": logical,
        "simd": [f for f in _SIMD_FLAGS if f in flags],
        "ram_total": ram_total,
        "ram_available": ram_available,
        "apple_silicon": machine.is_apple_silicon(),
        "onnxruntime_providers": _onnx_providers(),
        "backends": _backend_facts(),
        "engine_tuning": _tuning_hint(),
    }
    facts.update(_gpu_facts())
    try:
        available = backends.available_backends()
        choice = backends.choose("auto", None, available, lambda name, arch: True,
                                 backends.auto_blockers(available))
        facts["run_would_use"] = {"backend": choice.backend, "reason": choice.reason}
    except Exception as e:   # no backend installed: say so rather than fail the report
        facts["run_would_use"] = {"backend": None, "reason": str(e)}
    return facts


def _onnx_providers() -> list[str] | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    return list(onnxruntime.get_available_providers())


def _gpu_facts() -> dict:
    """llama.cpp's devices as its registry reports them, the GPU drivers loaded here, and the
    command that rebuilds the engine for a GPU it cannot use (None when there is none)."""
    from localinfer.backends.llama import devices as llama_devices
    from localinfer.backends.llama import rpc
    from localinfer.fit import gpu
    found = llama_devices.devices()
    has_rpc = rpc.supported()
    return {"devices": [d.as_dict() for d in found],
            "rpc": {"supported": has_rpc, "workers": list(rpc.requested()),
                    "hint": None if has_rpc or not found else gpu.this_rebuild_hint(found, rpc=True)},
            "placement": gpu.placement_rule(found, apple_silicon=machine.is_apple_silicon()),
            "gpu_hardware": [h.what for h in
                             gpu.present(apple_silicon=machine.is_apple_silicon())],
            "gpu_hint": gpu.this_rebuild_hint(found)}


def _tuning_hint() -> str | None:
    """A sentence when the loaded llama.cpp was tuned for an older CPU than this one."""
    try:
        from llama_cpp import llama_cpp as bindings
    except Exception:       # no engine installed, or one that does not load: nothing to tell
        return None
    from pathlib import Path

    from localinfer.backends.llama import tuning
    return tuning.hint(Path(bindings._base_path))


def _backend_facts() -> dict:
    facts = {}
    for name, available in backends.available_backends().items():
        entry: dict = {"available": available}
        if available:
            try:
                entry.update(backends.get(name).describe())
            except Exception as e:
                entry["error"] = str(e)
        facts[name] = entry
    return facts
