"""Where the Triton kernel tests can run, and the marks that say so.

Triton decides at import time whether kernels are interpreted (TRITON_INTERPRET=1), and
vLLM / Megatron import triton too, so the suite never sets the variable in its own process
(it would leak into every later test and into the engine subprocesses). On a CPU machine the
kernel modules skip themselves in-process and `test_interpreter_suite.py` runs them in a
subprocess with TRITON_INTERPRET=1; on a CUDA machine they run in-process, marked `gpu`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SKIP_REASON = (
    "Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before triton is imported; "
    "tests/triton/test_interpreter_suite.py runs this module under the interpreter"
)


def interpreting() -> bool:
    if not HAVE_TRITON:
        return False
    from isoexec.ops.triton._runtime import interpreting as _interp

    return _interp()


def kernel_marks() -> list[pytest.MarkDecorator]:
    """`pytestmark` of a module that launches kernels; skips the whole module (one line in
    the report) where kernels cannot run."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed", allow_module_level=True)
    if CUDA:
        return [pytest.mark.gpu]
    if not interpreting():
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return []
