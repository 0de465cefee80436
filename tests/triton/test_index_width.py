"""Every Triton kernel computes its pointer offsets in 64-bit integers.

Why: an int32 offset such as `rm * stride_xm` wraps past 2**31 elements and then reads or
writes the wrong memory without an error. The lm head's [rows, 151936] logits pass 2**31
from about 14,134 rows, and the trainer scores whole packs in one forward. Running a kernel
that large needs tensors of more than 4 GiB, so instead each kernel is compiled to TTIR for
an sm_90 target (frontend and TTIR passes only: no GPU, no driver) and every `tt.addptr`
offset is traced back through the ops that compute it: each add/sub/mul/shift on the way
must be i64, unless its inputs are only `tl.arange` lanes and constants (bounded by a
constexpr block width). An i32 value added to a pointer as it is (a kernel argument, a
program id, a loaded index) is exact; only arithmetic can wrap. Small int32 kernels (the
old `rm * stride` form, a cast made after the multiply, a product that only reaches a loop
bound) show that the check catches each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import pytest
from _triton_testlib import HAVE_TRITON, interpreting

if not HAVE_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
if interpreting():
    pytest.skip("compiles JIT kernels; TRITON_INTERPRET=1 replaces them", allow_module_level=True)

import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction

from isoexec.ops.triton import (
    attention,
    elementwise,
    gdn,
    gemm,
    logprobs,
    moe,
    norm,
)

TARGET = GPUTarget("cuda", 90, 32)
KERNEL_MODULES: tuple[ModuleType, ...] = (attention, elementwise, gdn, gemm, logprobs, moe, norm)

# Integer ops that can wrap; values through them must be i64 unless bounded by constants.
_WRAPPING = frozenset({"arith.addi", "arith.subi", "arith.muli", "arith.shli"})
_SHAPE = frozenset({"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape"})
_CONSTANT = frozenset({"arith.constant", "tt.make_range"})
_DEF = re.compile(r'^(%\w+)(?::\d+)? = ([\w."]+)(.*)$')
_FOR = re.compile(r"scf\.for (%\w+) = (%\w+) to (%\w+) step (%\w+)(?: iter_args\(([^)]*)\))?")
_ITER = re.compile(r"(%\w+) = (%\w+)")
_USE = re.compile(r"%\w+")
_YIELD = ("scf.yield", "tt.reduce.return", "tt.scan.return")


@dataclass(frozen=True)
class _Op:
    name: str
    operands: tuple[str, ...]
    type: str  # result type
    line: str


def _parse(ttir: str) -> dict[str, _Op]:
    """SSA name -> defining op, for a module with one (inlined) function. A region op's
    results also depend on what its regions yield, a loop index on the loop's bounds and a
    loop-carried value on its initial and yielded values."""
    assert ttir.count("tt.func ") == 1, "expected a single inlined kernel"
    defs: dict[str, _Op] = {}
    open_ops: list[str | None] = []  # result of each enclosing region op
    for line in (raw.strip() for raw in ttir.splitlines()):
        if line.startswith("}"):  # "}", "})", or "} else {"
            if not line.endswith("{"):
                open_ops.pop()
            continue
        if line.startswith(_YIELD) and open_ops and (owner := open_ops[-1]):
            defs[owner] = replace(
                defs[owner], operands=defs[owner].operands + tuple(_USE.findall(line))
            )
        res = None
        if m := _DEF.match(line):
            res, name, rest = m.groups()
            body, _, ty = rest.rpartition(" : ")
            defs[res] = _Op(name, tuple(_USE.findall(body)), ty.rsplit("->")[-1].strip(), line)
        if f := _FOR.search(line):
            iv, lb, ub, step, iters = f.groups()
            defs[iv] = _Op("scf.for.iv", (lb, ub, step), "", line)
            for arg, init in _ITER.findall(iters or ""):
                defs[arg] = _Op("scf.for.iter_arg", (init, *([res] if res else [])), "", line)
        if line.endswith("{"):
            open_ops.append(res)
    return defs


def _is_i64(ty: str) -> bool:
    return ty == "i64" or ty.endswith("xi64>")


def narrow_offsets(ttir: str) -> list[str]:
    """The TTIR lines where a pointer offset is computed by narrow (non-i64) integer
    arithmetic on runtime values; empty when all offset arithmetic is 64-bit."""
    defs = _parse(ttir)

    def bounded(v: str) -> bool:
        op = defs.get(v)  # None: a kernel or loop argument, i.e. a runtime value
        if op is None or op.name not in _CONSTANT | _SHAPE | _WRAPPING:
            return False
        return op.name in _CONSTANT or all(bounded(o) for o in op.operands)

    bad: list[str] = []
    seen: set[str] = set()

    def visit(v: str) -> None:
        op = defs.get(v)
        if v in seen or op is None or op.name == "tt.load":  # loaded data is not arithmetic
            return
        seen.add(v)
        if op.name in _WRAPPING and not _is_i64(op.type) and not bounded(v):
            bad.append(op.line)
        for o in op.operands:
            visit(o)

    for op in list(defs.values()):
        if op.name == "tt.addptr":
            visit(op.operands[1])
    return bad


def compile_ttir(fn: JITFunction, constexprs: dict[str, Any], types: dict[str, str]) -> str:
    """`fn`'s TTIR for sm_90; `*_ptr` args default to bf16 pointers, other args to i32 (how
    Triton specialises an int below 2**31, e.g. every stride)."""
    signature = {
        a: "constexpr"
        if a in constexprs
        else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
        for a in fn.arg_names
    }
    backend = make_backend(TARGET)
    options = backend.parse_options({"enable_fp_fusion": False})  # float codegen only
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn, signature, constexprs)
    mod = src.make_ir(
        TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx
    )
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, src.language)
    return str(stages["ttir"](mod, {}).str_nodebug())


@dataclass(frozen=True)
class Case:
    fn: JITFunction
    constexprs: dict[str, Any]
    types: dict[str, str]


_I32P, _I64P, _F32P, _F32 = "*i32", "*i64", "*fp32", "fp32"
_ATTN_TYPES = {"qpos_ptr": _I32P, "kbase_ptr": _I32P, "req_ptr": _I32P, "bt_ptr": _I32P}
_ATTN = {"GROUP": 2, "BLOCK_D": 128, "BLOCK_DV": 128, "KV_TILE": 16}
_LP = {"APPLY_T": True, "TILE": 1024}
CASES: dict[str, Case] = {
    "gemm": Case(
        gemm._linear_kernel, {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "PRECISION": "tf32"}, {}
    ),
    "attention_varlen": Case(
        attention._attn_kernel,
        {**_ATTN, "PAGED": False, "PAGE": 1},
        {**_ATTN_TYPES, "scale": _F32},
    ),
    "attention_paged": Case(
        attention._attn_kernel,
        {**_ATTN, "PAGED": True, "PAGE": 16},
        {**_ATTN_TYPES, "scale": _F32},
    ),
    "rope": Case(
        elementwise._rope_kernel,
        {"BLOCK_HALF": 32, "BLOCK_PASS": 64},
        {"cos_ptr": _F32P, "sin_ptr": _F32P},
    ),
    "silu_mul": Case(elementwise._silu_mul_kernel, {"BLOCK": 1024}, {}),
    "rms_norm": Case(
        norm._rms_norm_kernel,
        {"BLOCK_D": 4096, "HAS_RES": True, "ZERO_CENTERED": True},
        {"eps": _F32},
    ),
    "gated_rms_norm": Case(norm._gated_rms_norm_kernel, {"BLOCK_D": 4096}, {"eps": _F32}),
    "gdn_conv": Case(gdn._conv_kernel, {"W": 4, "BLOCK": 256, "HAS_BIAS": True}, {}),
    "gdn_recurrence": Case(
        gdn._recurrence_kernel,
        {"REP": 2, "BLOCK_K": 128, "BLOCK_V": 64, "HAS_STATE": True},
        {"s0_ptr": _F32P, "s_ptr": _F32P, "sqrt_dk": _F32, "eps": _F32},
    ),
    "logprobs_full": Case(
        logprobs._logprobs_kernel,
        {**_LP, "FULL": True},
        {"ids_ptr": _I64P, "out_ptr": _F32P, "temperature": _F32},
    ),
    "logprobs_token": Case(
        logprobs._logprobs_kernel,
        {**_LP, "FULL": False},
        {"ids_ptr": _I64P, "out_ptr": _F32P, "temperature": _F32},
    ),
    "logprobs_leaves": Case(
        logprobs._leaf_stats_kernel,
        {**_LP, "LEAVES": 16},
        {"m_ptr": _F32P, "s_ptr": _F32P, "temperature": _F32},
    ),
    "moe_router": Case(
        moe._router_kernel,
        {"TOP_K": 8, "BLOCK_E": 128, "BLOCK_K": 8, "RENORM": True},
        {"w_ptr": _F32P, "ids_ptr": _I64P},
    ),
    "moe_combine": Case(
        moe._combine_kernel,
        {"TOP_K": 8, "BLOCK": 1024, "HAS_SHARED": True, "HAS_GATE": True},
        {"w_ptr": _F32P, "order_ptr": _I64P},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_offsets_are_64_bit(name: str) -> None:
    case = CASES[name]
    ttir = compile_ttir(case.fn, case.constexprs, case.types)
    assert "tt.addptr" in ttir
    bad = narrow_offsets(ttir)
    assert not bad, f"{name}: 32-bit pointer offset arithmetic:\n" + "\n".join(sorted(set(bad)))


def test_every_kernel_is_checked() -> None:
    """A new kernel needs a case above."""
    kernels = {
        f"{m.__name__}.{k}"
        for m in KERNEL_MODULES
        for k, v in vars(m).items()
        if isinstance(v, JITFunction) and k.endswith("_kernel")
    }
    checked = {f"{c.fn.__module__}.{c.fn.__name__}" for c in CASES.values()}
    assert kernels == checked


# Negative controls: the check flags int32 offsets.
@triton.jit
def _int32_rows_kernel(x_ptr, y_ptr, M, stride_xm, BLOCK_M: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # the old gemm.py form
    tl.store(y_ptr + rm, tl.load(x_ptr + rm * stride_xm, mask=rm < M), mask=rm < M)


@triton.jit
def _late_cast_kernel(x_ptr, y_ptr, M, stride_xm, BLOCK_M: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.program_id(1)
    off = (row * stride_xm).to(tl.int64)  # i64 offset, but the product already wrapped
    tl.store(y_ptr + rm, tl.load(x_ptr + off + rm, mask=rm < M), mask=rm < M)


@triton.jit
def _loop_bound_kernel(x_ptr, y_ptr, M, stride_xm, BLOCK_M: tl.constexpr):
    row = tl.program_id(0)  # the old logprobs.py form: the product only reaches a loop bound
    lanes = tl.arange(0, BLOCK_M)
    for v0 in range(row * stride_xm, row * stride_xm + M, BLOCK_M):
        tl.store(y_ptr + lanes, tl.load(x_ptr + v0 + lanes))


@triton.jit
def _int64_rows_kernel(x_ptr, y_ptr, M, stride_xm, BLOCK_M: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(y_ptr + rm, tl.load(x_ptr + rm * stride_xm, mask=rm < M), mask=rm < M)


@pytest.mark.parametrize(
    ("fn", "flagged"),
    [
        (_int32_rows_kernel, ["arith.muli", "xi32>"]),
        (_late_cast_kernel, ["arith.muli", ": i32"]),
        (_loop_bound_kernel, ["arith.muli", ": i32"]),
        (_int64_rows_kernel, []),
    ],
    ids=["int32", "cast-after-multiply", "loop-bound", "int64"],
)
def test_check_flags_int32_offsets(fn: JITFunction, flagged: list[str]) -> None:
    bad = narrow_offsets(compile_ttir(fn, {"BLOCK_M": 64}, {}))
    if flagged:
        assert any(all(f in line for f in flagged) for line in bad), bad
    else:
        assert not bad, bad
