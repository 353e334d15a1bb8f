"""What the scripts fetch and build, in one cache: llama.cpp's own tools (llama-bench,
llama-server, llama-perplexity, ...) built from the llama.cpp that the installed llama-cpp-python
vendors, which the scripts measure localinfer against, and the venvs of the scripts that need
another onnxruntime beside the project's.

    from llama_tools import ensure_tool
    server = ensure_tool("llama-server")      # a Path; built on first use, cached after

The cache is ~/.cache/localinfer-bench, or the folder LOCALINFER_BENCH_CACHE names (read here
only: `cache_root()`), so a test can start from an empty one. The first call downloads the
llama-cpp-python sdist (`pip download`, so pip's configuration applies), extracts vendor/llama.cpp
into CACHE/llama.cpp-VERSION/src and configures one build folder for it; each tool is then one
cmake target built into that folder (a few minutes on 2 cores for the first, less for the next:
the libraries are shared). One progress line per step on stderr; each step's own output goes to
a log file beside the build, whose tail is shown when the step fails. A missing requirement
(cmake, a C++ compiler, pip access to the sdist) is one line saying what to install. A build is
compiled for the CPU features the wheel was built with (`wheel_cpu_options`), never
-march=native: a VM that reports AMX but leaves it off kills a native build's binaries with
SIGILL. Builds into one folder are serialised by a lock file, so two scripts started together do
not run two cmake builds over each other.

Stdlib only (llama_cpp is imported only to read the wheel's CPU features).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

CACHE_ENV = "LOCALINFER_BENCH_CACHE"  # moves the whole cache (sources, builds, venvs, logs)
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",      # llama-server's target exists; only the targets asked are built
    "-DLLAMA_OPENSSL=OFF",
]
CPU_BUILD = "build-wheel-cpu"       # the folder CPU builds go to, beside the source


class BenchError(RuntimeError):
    """A step failed; the message is printed as a single error line."""


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """The folder everything fetched or built for the scripts lives in."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "localinfer-bench")


def installed_llama_cpp_version() -> str:
    """The installed llama-cpp-python's version."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise BenchError("llama-cpp-python is not installed in this interpreter "
                         f"({sys.executable}); install it or pass --llama-cpp-version") from None


def source_root(version: str | None = None) -> Path:
    """Where one llama-cpp-python version's llama.cpp lives: sdist/, src/ and the build folders."""
    return cache_root() / f"llama.cpp-{version or installed_llama_cpp_version()}"


def run_logged(cmd: list[str], log_file: Path, what: str) -> None:
    """Run one step with its output in log_file (a build's thousands of lines are not progress);
    on failure the log's tail, then BenchError naming the step and the log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-20:]
        print("\n".join(tail), file=sys.stderr)
        raise BenchError(f"{what} failed (exit {result.returncode}); its output: {log_file}")


def download_sdist(version: str, dest: Path) -> Path:
    """The llama-cpp-python sdist in dest, downloaded if it is not there yet."""
    pattern = f"llama_cpp_python-{version}.tar.gz"
    existing = list(dest.glob(pattern))
    if existing:
        return existing[0]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading the llama-cpp-python {version} sdist into {dest}")
    try:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(dest)],
                   dest / "pip-download.log", "downloading the sdist")
    except BenchError as e:
        raise BenchError(f"{e}: pip needs access to the package index (or put "
                         f"{pattern} into {dest} by hand)") from None
    found = list(dest.glob(pattern)) or list(dest.glob("llama*cpp*python*.tar.gz"))
    if not found:
        raise BenchError(f"pip download left no llama-cpp-python sdist in {dest}")
    return found[0]


def extract_vendored_llama_cpp(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist extracted into dest (kept when already there)."""
    if (dest / "CMakeLists.txt").exists():
        return dest
    log(f"extracting vendor/llama.cpp from {sdist.name}")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        if not members:
            raise BenchError(f"{sdist} contains no vendor/llama.cpp directory")
        tar.extractall(tmp, members=members, filter="data")
        top = members[0].name.split("/", 1)[0]
        shutil.move(str(Path(tmp) / top / "vendor" / "llama.cpp"), str(dest))
    return dest


def ensure_source(version: str | None = None, root: Path | None = None) -> Path:
    """The vendored llama.cpp source tree of the installed (or given) llama-cpp-python version."""
    version = version or installed_llama_cpp_version()
    root = root or source_root(version)
    root.mkdir(parents=True, exist_ok=True)
    return extract_vendored_llama_cpp(download_sdist(version, root / "sdist"), root / "src")


# llama_print_system_info()'s CPU features -> the ggml cmake option that compiles them in.
WHEEL_FEATURES = {"AVX": "GGML_AVX", "AVX_VNNI": "GGML_AVX_VNNI", "AVX2": "GGML_AVX2",
                  "F16C": "GGML_F16C", "FMA": "GGML_FMA", "BMI2": "GGML_BMI2",
                  "AVX512": "GGML_AVX512", "AVX512_VBMI": "GGML_AVX512_VBMI",
                  "AVX512_VNNI": "GGML_AVX512_VNNI", "AVX512_BF16": "GGML_AVX512_BF16",
                  "AMX_INT8": "GGML_AMX_INT8", "LLAMAFILE": "GGML_LLAMAFILE",
                  "OPENMP": "GGML_OPENMP"}


def wheel_cpu_options() -> tuple[str, ...]:
    """cmake options that compile for the CPU features the installed wheel was built with, instead
    of -march=native: both sides then run the same instruction sets, and a CPU that reports a
    feature its hypervisor does not enable (AMX tiles in some VMs: SIGILL in a native build) does
    not break the build's binaries."""
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode()
    found = dict(re.findall(r"(\w+) = (\d)", info))
    options = {option: found.get(name) == "1" for name, option in WHEEL_FEATURES.items()}
    # No AMX: the repacked AMX buffers run tile loads that fault (SIGILL) where the CPU reports
    # AMX but the VM leaves it off (measured here: tileloadd in libggml-cpu), and the wheel,
    # loaded through llama-cpp-python, runs its matrix products without them.
    options["GGML_AMX_INT8"] = options["GGML_AMX_TILE"] = options["GGML_AMX_BF16"] = False
    return ("-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if on else 'OFF'}"
                                   for option, on in options.items()))


def tool_path(name: str, build_name: str = CPU_BUILD, version: str | None = None,
              root: Path | None = None) -> Path:
    """Where tool `name` of a build folder lives (whether or not it is built yet); `root`: the
    folder holding sdist/, src/ and the builds (default: source_root(version))."""
    return (root or source_root(version)) / build_name / "bin" / name


def check_build_tools(name: str) -> None:
    """One line naming what is missing to build tool `name`, before anything is downloaded."""
    if shutil.which("cmake") is None:
        raise BenchError(f"cmake not found on PATH; it is needed to build {name} "
                         "(e.g. `apt-get install cmake` or `pip install cmake`)")
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        raise BenchError(f"no C++ compiler (c++, g++ or clang++) on PATH; one is needed to build "
                         f"{name} (e.g. `apt-get install g++`, or Xcode's command line tools)")


@contextmanager
def _build_lock(build: Path):
    build.mkdir(parents=True, exist_ok=True)
    with open(build.parent / f".{build.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_tool(name: str, *, jobs: int = 2, extra_options: tuple[str, ...] | None = None,
                build_name: str = CPU_BUILD, version: str | None = None,
                root: Path | None = None) -> Path:
    """The path of llama.cpp's tool `name` (its cmake target: llama-bench, llama-server,
    llama-perplexity, llama-quantize, ...), built first if it is not there yet.

    `extra_options`: cmake options of the build (None: `wheel_cpu_options()`); a build with
    other options (a GPU backend's) goes to a `build_name` of its own beside the CPU one, from
    the same source."""
    binary = tool_path(name, build_name, version, root)
    if binary.exists():
        log(f"using cached {binary}")
        return binary
    check_build_tools(name)
    source = ensure_source(version, root)
    build = binary.parent.parent
    with _build_lock(build):
        if binary.exists():             # another script built it while this one waited
            return binary
        started = time.monotonic()
        options = wheel_cpu_options() if extra_options is None else extra_options
        log(f"configuring {build}")
        run_logged(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS, *options],
                   build / "logs" / "configure.log", "cmake's configure step")
        log(f"building {name} in {build} (minutes the first time: the libraries too)")
        run_logged(["cmake", "--build", str(build), "--config", "Release", "--target", name,
                    "-j", str(jobs)], build / "logs" / f"{name}.log", f"the build of {name}")
        if not binary.exists():
            raise BenchError(f"the build finished but {binary} does not exist")
        log(f"built {binary} in {time.monotonic() - started:.0f} s")
    return binary


def ensure_venv(name: str, packages: list[str], ready: str) -> Path:
    """The python of venv `name` in the cache, made (or remade) with `packages` when the code
    `ready` does not exit 0 in it: for a script whose other side needs an onnxruntime that would
    replace the project's own."""
    venv = cache_root() / name
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", ready],
                                          capture_output=True).returncode == 0:
        log(f"using cached {venv}")
        return python
    log(f"making {venv} with {' '.join(packages)} (once)")
    logs = cache_root() / "logs"
    run_logged([sys.executable, "-m", "venv", "--clear", str(venv)], logs / f"{name}.log",
               f"making {venv}")
    run_logged([str(python), "-m", "pip", "install", *packages], logs / f"{name}-pip.log",
               f"pip install {' '.join(packages)} (it needs access to the package index)")
    run_logged([str(python), "-c", ready], logs / f"{name}-check.log",
               f"the check of {venv} after the install")
    return python


def main(argv: list[str] | None = None) -> int:
    """`python scripts/llama_tools.py llama-server ...`: build the tools, print their paths."""
    import argparse
    parser = argparse.ArgumentParser(description="Build llama.cpp's tools from the vendored "
                                     "source of the installed llama-cpp-python.")
    parser.add_argument("tools", nargs="+", metavar="TOOL", help="e.g. llama-bench llama-server")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    try:
        for name in args.tools:
            print(ensure_tool(name, jobs=args.jobs))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
