"""The devices llama.cpp computes on, as the engine itself reports them: ggml's backend registry.

`read_registry` is the one place that asks the loaded engine (the hardware boundary); everything
else takes its list, so tests hand in a described machine's devices instead. The CPU device's
free memory is not a measurement (ggml reports total = free on Linux), so the RAM budget keeps
coming from the operating system; a GPU's free memory is what its driver reports
(cudaMemGetInfo for CUDA and ROCm, Metal's recommended working set less what is allocated).

llama-cpp-python binds none of the registry functions, so they are bound here, through the
libllama the package loaded (`engine_ggml`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import asdict, dataclass

# enum ggml_backend_dev_type (ggml-backend.h), in order.
KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


@dataclass(frozen=True)
class Device:
    name: str              # ggml's device name: CPU, CUDA0, MTL0, Vulkan0, ROCm0
    description: str       # e.g. "NVIDIA GeForce RTX 4060 Laptop GPU"
    kind: str              # cpu, gpu (own memory), igpu (shares the host's), accel, meta
    backend: str           # the ggml backend that drives it: CPU, CUDA, ROCm, MTL, Vulkan, ...
    memory_free: int
    memory_total: int

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Offload:
    """Where llama.cpp put a loaded model's layers."""

    gpu_layers: int                 # layers on the GPUs (the output layer counts as one)
    layers: int                     # all of them: n_layer + 1
    devices: tuple[str, ...]        # the GPUs that hold them, "CUDA0 (NVIDIA ...)"
    no_gpu: bool = False            # the engine has no GPU to offload to
    cpu_moe: int = 0                # layers (the first) whose experts were kept in host memory
    shares: tuple[int, ...] = ()    # layers on each of `devices` (llama_shares)

    @property
    def remote(self) -> bool:
        """Whether RPC workers hold some of the layers."""
        return any(name.startswith("RPC") for name in self.devices)

    def as_dict(self) -> dict:
        return {"gpu_layers": self.gpu_layers, "cpu_layers": self.layers - self.gpu_layers,
                "layers": self.layers, "gpu_devices": list(self.devices),
                "device_layers": dict(zip(self.devices, self.shares)),
                "engine_has_gpu": not self.no_gpu, "cpu_moe_layers": self.cpu_moe}

    def identity(self) -> dict:
        """For a prompt-cache key: states computed by GPU kernels are kept apart from the CPU's
        (and the key of a CPU-only session stays what it was before GPUs were placed); experts
        computed on the CPU are kernels of their own too."""
        if not self.gpu_layers:
            return {}
        moe = [f"cpu_moe={self.cpu_moe}"] if self.cpu_moe else []
        return {"offload": [self.gpu_layers, *self.devices, *moe]}


class _Registry:
    def __init__(self) -> None:
        from localinfer.backends.llama.engine import engine_ggml
        ggml = engine_ggml()

        def bind(name, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, ggml))
        p, size = ctypes.c_void_p, ctypes.c_size_t
        self.count = bind("ggml_backend_dev_count", size)
        self.get = bind("ggml_backend_dev_get", p, size)
        self.name = bind("ggml_backend_dev_name", ctypes.c_char_p, p)
        self.description = bind("ggml_backend_dev_description", ctypes.c_char_p, p)
        self.type = bind("ggml_backend_dev_type", ctypes.c_int, p)
        self.memory = bind("ggml_backend_dev_memory", None, p, ctypes.POINTER(size),
                           ctypes.POINTER(size))
        self.reg = bind("ggml_backend_dev_backend_reg", p, p)
        self.reg_name = bind("ggml_backend_reg_name", ctypes.c_char_p, p)
        self.reg_proc = bind("ggml_backend_reg_get_proc_address", p, p, ctypes.c_char_p)
        self.by_type = bind("ggml_backend_dev_by_type", p, ctypes.c_int)
        self.buft_name = bind("ggml_backend_buft_name", ctypes.c_char_p, p)
        self.dev_buffer_type = bind("ggml_backend_dev_buffer_type", p, p)


@functools.lru_cache(maxsize=1)
def _registry() -> _Registry:
    return _Registry()


def read_registry() -> list[Device]:
    """Every device of the loaded engine with its free and total memory now (the hardware
    boundary: the one function that asks ggml), the workers this process asked for among them
    (rpc.connect; a worker's description is its address, not the relay's ggml was given)."""
    from localinfer.backends.llama import rpc
    api = _registry()
    rpc.connect()
    found = []
    for i in range(api.count()):
        dev = api.get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        api.memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = api.type(dev)
        reg = api.reg(dev)
        found.append(Device(
            name=_text(api.name(dev)), description=rpc.shown(_text(api.description(dev))),
            kind=KINDS[kind] if 0 <= kind < len(KINDS) else f"type {kind}",
            backend=_text(api.reg_name(reg)) if reg else "", memory_free=free.value,
            memory_total=total.value))
    return found


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def devices() -> list[Device]:
    """The engine's devices; empty when llama.cpp is not installed or offers no registry."""
    try:
        return read_registry()
    except (ImportError, OSError, AttributeError):
        return []


def has_local_gpu() -> bool:
    """Whether the engine has a GPU of this machine to offload to (RPC workers are not one)."""
    return any(d.is_gpu and d.backend != "RPC" for d in devices())


def offload_targets(found: list[Device]) -> list[Device]:
    """The devices llama.cpp's default selection offloads layers to (llama.cpp's
    llama_model_load_from_file): every discrete GPU, else the integrated GPUs of one backend."""
    gpus = [d for d in found if d.kind == "gpu" and d.backend != "RPC"]
    if gpus:
        return gpus
    igpus = [d for d in found if d.kind == "igpu"]
    return [d for d in igpus if d.backend == igpus[0].backend]


def model_devices(found: list[Device]) -> list[Device]:
    """The devices llama.cpp's default selection puts layers on, in its order: the RPC workers
    first ("to minimize network transfers"), then `offload_targets`."""
    return [d for d in found if d.backend == "RPC"] + offload_targets(found)


def llama_shares(n: int, frees: list[int]) -> list[int]:
    """How llama.cpp splits `n` offloaded layers over its devices by their free memory: layer k
    goes to the first device whose cumulative share exceeds k/n, in float32 as llama.cpp does."""
    import numpy as np
    if n <= 0 or not frees or not any(frees):
        return [0] * len(frees)
    splits = np.cumsum(np.asarray(frees, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32)
    positions = np.arange(n, dtype=np.float32) / np.float32(n)
    device = np.minimum(np.searchsorted(splits, positions, side="right"), len(frees) - 1)
    return np.bincount(device, minlength=len(frees)).tolist()


def placed_layers(n_gpu_layers: int, n_layer: int, found: list[Device]) -> Offload:
    """Where llama.cpp puts the layers for `n_gpu_layers` (llama_model_base::load_tensors): the
    last n of n_layer + 1 (the output layer is the last), all for a negative n, none without a
    device to put them on; split between the devices by their free memory."""
    targets = model_devices(found)
    total = n_layer + 1
    wanted = total if n_gpu_layers < 0 else min(n_gpu_layers, total)
    on_gpu = wanted if targets else 0
    names = tuple(f"{d.name} ({d.description})" if d.description else d.name for d in targets)
    shares = tuple(llama_shares(on_gpu, [d.memory_free for d in targets]))
    return Offload(on_gpu, total, names if on_gpu else (), no_gpu=not offload_targets(found),
                   shares=shares if on_gpu else ())


def cpu_weight_buffers() -> tuple[str, ...]:
    """The CPU backend's extra weight buffer types, in the order llama.cpp tries them ("AMX",
    "CPU_REPACK", ...): the ones it repacks weights into for its faster kernels on this CPU."""
    try:
        api = _registry()
        cpu = api.by_type(0)                                   # GGML_BACKEND_DEVICE_TYPE_CPU
        address = api.reg_proc(api.reg(cpu), b"ggml_backend_dev_get_extra_bufts") if cpu else None
    except (ImportError, OSError, AttributeError):
        return ()
    if not address:
        return ()
    listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(cpu)
    names = []
    while listed and listed[len(names)]:                      # a NULL-terminated array
        names.append(_text(api.buft_name(listed[len(names)])))
    return tuple(names)


def uses_weight_buffers() -> bool:
    """Whether models load into the CPU's extra weight buffers (llama.cpp's use_extra_bufts).

    Not where the engine offers AMX: the AMX matrix kernels of this llama.cpp (0.3.36's vendored
    copy) crash with SIGSEGV on the first batch of more than one token, every model and type we
    ship (measured on a Xeon with AMX under a Linux 6.18 VM). Without extra buffers the plain
    AVX-512 kernels run instead; llama.cpp's own tools need `--no-repack` (llama-bench: `--repack 0`) there too.
    """
    return "AMX" not in cpu_weight_buffers()


def model_offload(model, n_gpu_layers: int, cpu_moe: int = 0) -> Offload:
    """Where llama.cpp put the layers of a model it loaded with `n_gpu_layers` (and the experts
    of its first `cpu_moe` layers overridden to host memory)."""
    from dataclasses import replace

    from llama_cpp import llama_cpp
    n_layer = llama_cpp.llama_model_n_layer(model) + llama_cpp.llama_model_n_layer_nextn(model)
    return replace(placed_layers(n_gpu_layers, n_layer, devices()),
                   cpu_moe=min(cpu_moe, n_layer))
