"""Run the Triton kernel tests under Triton's interpreter, in a subprocess
(`tests/_support/interpreter.py` says why a subprocess). The interpreter proves a
kernel's *structure* (a row's result does not depend on M, neighbours, decode split); its
bits say nothing about GPU bits (integration/gpu/run_checks.py checks those on CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _triton_testlib import CUDA, HAVE_TRITON

from tests._support.interpreter import pytest_under_interpreter

HERE = Path(__file__).resolve().parent
MODULES = [
    "test_kernels.py",
    "test_negative_controls.py",
    "test_paged_cache.py",
    "test_graph_safety.py",
]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA, reason="a CUDA machine runs the kernel modules in-process on the GPU")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="already under the interpreter"
)
@pytest.mark.parametrize("module", MODULES)
def test_under_interpreter(module: str) -> None:
    pytest_under_interpreter(str(HERE / module))
