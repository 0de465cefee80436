"""IsoExec's compiled CPU kernels: C++ sources built once per machine, loaded with ctypes.

Why compiled, and why this way (docs/ops.md, "Compiled CPU kernels"): a fixed-order kernel
must spell out its own reduction order, and only a compiled loop does that at native speed;
torch ops hand the order to a BLAS whose blocking depends on the shape. The sources use GCC
vector extensions with explicit lane counts and build with `-ffp-contract=off` and no
fast-math, so the bits are the source's whatever the ISA, the vendor or the compiler's
vectorization (`simd.h`). They include no torch or Python headers: a build takes about a
second, so it happens at first use, into a per-machine cache keyed by the sources, the
compiler and the CPU, under a file lock (parallel test workers and engine processes share
one build). No compiler is a loud error: a canonical op never falls back to another kernel.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
# Every source a kernel library is built from, in order: part of each op's fingerprint.
SOURCES: dict[str, tuple[str, ...]] = {
    "attention": ("simd.h", "attention.cpp"),
    "gemm": ("simd.h", "gemm.cpp"),
    "gdn": ("simd.h", "gdn.cpp"),
    "kvcache": ("kvcache.cpp",),
    "moe": ("simd.h", "moe.cpp"),
    "norm": ("simd.h", "norm.cpp"),
    "rope": ("simd.h", "rope.cpp"),
}
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-march=native",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fopenmp",
)


# What the kernels' `dtype` arguments mean (simd.h `DType`), and the ctypes argument types
# every wrapper declares.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
I64 = ctypes.c_int64
PTR = ctypes.c_void_p


def source_text(name: str) -> str:
    """The sources of library `name`, concatenated (what its bits are defined by)."""
    return "\0".join((_HERE / f).read_text() for f in SOURCES[name])


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError(
            "IsoExec's canonical CPU kernels are C++ compiled at first use, and no C++ compiler "
            "was found (set CXX, or install g++ / build-essential). IsoExec does not fall back "
            "to a native kernel."
        )
    return cxx


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isoexec" / "kernels"


def _build(
    name: str,
    sources: tuple[str, ...],
    flags: tuple[str, ...],
    key_text: str,
    libs: tuple[str, ...] = (),
) -> Path:
    """The shared object built from `sources` with `flags`, linked with `libs` (after the
    sources: a linker drops a library it sees before anything needs it), from this machine's
    cache (built now, under a file lock, if missing); `key_text`: what else the build depends
    on."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    text = "\0".join((_HERE / f).read_text() for f in sources)
    key = hashlib.sha256(
        "\0".join(
            [text, cxx, version.stdout, " ".join(flags), " ".join(libs), key_text, _cpu_identity()]
        ).encode()
    ).hexdigest()[:20]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"{name}-{key}.so"
    if not so.exists():
        with open(out_dir / f"{name}-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not so.exists():
                tmp = so.with_suffix(f".{os.getpid()}.tmp")
                src = [str(_HERE / f) for f in sources if f.endswith(".cpp")]
                cmd = [cxx, *flags, f"-I{_HERE}", *src, *libs, "-o", str(tmp)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode != 0:
                    raise RuntimeError(
                        f"building IsoExec's {name} CPU kernel failed ({' '.join(cmd)}):\n"
                        f"{res.stderr[-4000:]}"
                    )
                os.replace(tmp, so)
    return so


@cache
def library(name: str) -> ctypes.CDLL:
    """The built library `name` (built now if this machine has no build of these sources)."""
    return ctypes.CDLL(str(_build(name, SOURCES[name], CXX_FLAGS, "")))


# The C++-registered torch operators (`torch_ops.cpp`) and the kernels they call. Only data
# movement is added to the kernels, so these sources are not part of an op's fingerprint.
TORCH_OP_SOURCES = (
    "simd.h", "norm.cpp", "gemm.cpp", "rope.cpp", "moe.cpp", "attention.cpp",
    "torch_ops.h", "torch_ops.cpp", "torch_ops_moe.cpp", "torch_ops_attention.cpp",
)  # fmt: skip


@cache
def torch_op_library() -> Path:
    """Build (once per machine) and load `torch.ops.isoexec_cpu`; the library's path.

    Built against the running torch's headers and libraries, with its C++ ABI: the key holds
    torch's version and install path, so another torch builds its own."""
    root = Path(torch.__file__).resolve().parent
    include = root / "include"
    flags = (
        *CXX_FLAGS,
        "-w",  # torch's headers warn under -std=c++17; the kernels' sources build warning-free
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    )
    libs = (f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu")
    so = _build("torch_ops", TORCH_OP_SOURCES, flags, f"{torch.__version__}\0{root}", libs)
    torch.ops.load_library(str(so))
    return so


def ptr(t: object) -> ctypes.c_void_p:
    """Address of a tensor's first element (None: a null pointer)."""
    return ctypes.c_void_p(None if t is None else t.data_ptr())  # type: ignore[attr-defined]
