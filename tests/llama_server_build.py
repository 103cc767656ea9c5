"""Builds llama.cpp's `llama-server` for the test run and caches it.

`python tests/llama_server_build.py [--cuda]` (the Makefile's test install step; with --cuda
where an NVIDIA GPU and CUDA's compiler are, for the gpu-marked tests) builds only the
llama-server target (CPU, Release, GGML_NATIVE, two jobs) from the llama.cpp tree inside
llama-cpp-python's source distribution and keeps the binary under
~/.cache/shoal/llama-server/<key>/, the key naming the version, the source patch, the
CPU's flags and the build options, so a second run finds it and builds nothing.
Tests find it through `cached_binary()` (tests/runner/llama_server/conftest.py).

One line of llama.cpp is mended first, as bench/install_peer.sh does: on CPUs with AMX,
ggml's AMX matmul loads its tile configuration with ldtilecfg from a struct GCC 12 does not
see it read, so the stores are dropped and ldtilecfg faults. A compiler barrier naming the
struct keeps them. Without AMX the line never runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
_MMQ = "vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp"
_LOAD = "    _tile_loadconfig(&tc);\n"
_BARRIER = '    asm volatile("" : : "m"(tc) : "memory");  // keep tc\'s stores for ldtilecfg\n'
# No UI download (the build never touches the network beyond pip), no HTTPS, no tests.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
JOBS = 2


def cpu_flags() -> str:
    """The CPU's feature flags, which GGML_NATIVE compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return os.uname().machine


# For the gpu-marked tests on a machine with an NVIDIA GPU and CUDA's compiler: the same
# target built with CUDA, for the GPU's own architecture, without the FlashAttention kernels
# (a third of the compile time; llama-server runs without them).
CUDA_OPTIONS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native", "-DGGML_CUDA_FA=OFF",
                "-DGGML_CUDA_NCCL=OFF")


def options(cuda: bool) -> tuple[str, ...]:
    return CMAKE_OPTIONS + (CUDA_OPTIONS if cuda else ())


def cache_key(cuda: bool = False) -> str:
    digest = hashlib.sha256()
    for part in (VERSION, _BARRIER, cpu_flags(), *options(cuda)):
        digest.update(part.encode() + b"\0")
    return f"{VERSION}{'-cuda' if cuda else ''}-{digest.hexdigest()[:16]}"


def cache_dir(cuda: bool = False) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "shoal" / "llama-server" / cache_key(cuda)


def cached_binary(cuda: bool = False) -> Path | None:
    """The built llama-server for this CPU and these options (with CUDA: for the gpu
    tests), or None."""
    binary = cache_dir(cuda) / "llama-server"
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def _patch_amx(source: Path) -> None:
    path = source / _MMQ
    text = path.read_text()
    if _BARRIER in text:
        return
    if text.count(_LOAD) != 1:
        raise SystemExit(f"{path} changed; look at ggml_tile_config_init by hand")
    path.write_text(text.replace(_LOAD, _BARRIER + _LOAD))


# llama.cpp's converter, kept from the same source for tests that make GGUF files with it
# (tests/tiny_vision_model.py), so they never download the source again.
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def converter_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "shoal" / "llama-converter" / VERSION / "tree"


def keep_converter(tree: Path) -> Path:
    """Copy the converter's parts out of an unpacked llama.cpp tree into converter_dir()
    (whole or not at all); returns converter_dir()."""
    kept = converter_dir()
    if all((kept / part).exists() for part in CONVERTER_PARTS):
        return kept
    partial = kept.with_name("tree.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for part in CONVERTER_PARTS:
        copy = shutil.copytree if (tree / part).is_dir() else shutil.copy2
        copy(tree / part, partial / part)
    shutil.rmtree(kept, ignore_errors=True)
    partial.rename(kept)
    return kept


def fetch_converter() -> Path:
    """converter_dir(), downloading llama.cpp's source first if it is not kept yet."""
    kept = converter_dir()
    if all((kept / part).exists() for part in CONVERTER_PARTS):
        return kept
    with tempfile.TemporaryDirectory(prefix="shoal-llama-converter-") as scratch:
        return keep_converter(_download(Path(scratch)) / "vendor" / "llama.cpp")


def _cmake() -> str:
    """cmake from this Python's environment (pip's cmake package) or from PATH."""
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.is_file() else shutil.which("cmake")
    if found is None:
        raise SystemExit("building llama-server needs cmake: install it (apt-get install "
                         "cmake, or pip install cmake)")
    return found


def _download(work: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", str(work)],
        check=True,
    )
    with tarfile.open(work / f"llama_cpp_python-{VERSION}.tar.gz") as archive:
        archive.extractall(work, filter="data")
    return work / f"llama_cpp_python-{VERSION}"


def build(log=print, cuda: bool = False) -> Path:
    """Builds llama-server unless the cache holds it; returns the binary's path."""
    found = cached_binary(cuda)
    if found is not None:
        fetch_converter()  # kept by builds before the converter was
        return found
    target = cache_dir(cuda)
    jobs = (os.cpu_count() or JOBS) if cuda else JOBS
    cmake = _cmake()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-llama-server-") as scratch:
        work = Path(scratch)
        source = _download(work)
        _patch_amx(source)
        tree = source / "vendor" / "llama.cpp"
        keep_converter(tree)
        build_dir = work / "build"
        log(f"building llama-server {VERSION}{' with CUDA' if cuda else ''} (cmake, {jobs} "
            f"jobs) in {build_dir}")
        subprocess.run([cmake, "-S", str(tree), "-B", str(build_dir), *options(cuda)],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run([cmake, "--build", str(build_dir), "--target", "llama-server",
                        "-j", str(jobs)], check=True, stdout=subprocess.DEVNULL)
        built = build_dir / "bin" / "llama-server"
        target.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so a reader never sees half a binary.
        partial = target / "llama-server.partial"
        shutil.copy2(built, partial)
        partial.rename(target / "llama-server")
    log(f"built {target / 'llama-server'} in {time.monotonic() - started:.0f} s")
    return target / "llama-server"


if __name__ == "__main__":
    print(build(log=lambda line: print(line, file=sys.stderr), cuda="--cuda" in sys.argv[1:]))
