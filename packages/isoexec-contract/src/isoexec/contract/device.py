"""Detect the device identity a contract records: what under the ops can change bits.

PyTorch CPU kernels are vectorised per ISA (the transcendental tail-vs-SIMD effect differs
between AVX2 and AVX-512), Triton/CUDA kernels per GPU arch; both sides must agree on these,
so they go into the contract. torch is imported lazily so the CLI stays fast.
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from isoexec.contract.contract_types import DeviceIdentity
from isoexec.contract.patch_table import contract_patch_list

# CPU features that select different vector kernels (x86 `flags`, Arm `Features`).
ISA_FLAGS: frozenset[str] = frozenset(
    {
        # x86
        "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
        "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
        "avx512_vnni", "avx512_bf16", "avx512_fp16",
        "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
        # Arm
        "asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme",
    }
)  # fmt: skip


def cpu_isa(cpuinfo: str | None = None, *, machine: str | None = None) -> str:
    """`<machine>:[<vendor>:]<sorted ISA flags>` from /proc/cpuinfo (or the given text).

    Only the features kernels dispatch on are kept, so unrelated flags (e.g. a microcode
    mitigation) do not make two equivalent machines differ. The x86 vendor is kept too: the
    BLAS libraries under torch choose kernels and blockings by vendor as well as by ISA
    (measured: MKL's GEMMs on an AMD EPYC and an Intel Xeon with the same AVX-512 flags change
    bits under different conditions), so an Intel side and an AMD side never MATCH.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    vendor = ""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key == "vendor_id" and not vendor:
            vendor = value.strip()
        if sep and key in ("flags", "Features"):
            flags.update(value.split())
            break  # the first CPU speaks for all (heterogeneous cores share the ISA)
    kept = sorted(flags & ISA_FLAGS)
    head = f"{machine or platform.machine()}:{vendor + ':' if vendor else ''}"
    return f"{head}{','.join(kept) or 'baseline'}"


def detect_device(
    device: str | None = None,
    *,
    uses_triton: bool = False,
    record_threads: bool = False,
) -> DeviceIdentity:
    """The running device identity. `device` is "cpu" or "cuda" (default: cuda if available).

    `uses_triton`: include Triton's version (only when a Triton kernel is installed).
    `record_threads`: include `torch.get_num_threads()`, for backends whose bits depend on it
    (canonical ops do not; a side with native CPU sites might).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_kind = torch.device(device).type
    cuda: str | None = None
    if device_kind == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        arch = f"sm_{major}{minor}"
        cuda = torch.version.cuda or (f"hip-{torch.version.hip}" if torch.version.hip else None)
    else:
        capability = torch.backends.cpu.get_cpu_capability()
        arch = f"{cpu_isa()}:{capability}"
    triton: str | None = None
    if uses_triton:
        try:
            triton = metadata.version("triton")
        except metadata.PackageNotFoundError:
            triton = "missing"
    return DeviceIdentity(
        torch=str(torch.__version__),
        device_kind=device_kind,
        arch=arch,
        triton=triton,
        cuda=cuda,
        threads=torch.get_num_threads() if record_threads else None,
        patches=contract_patch_list(),
    )
