"""Position-invariant elementwise maths.

PyTorch's CPU kernels compute whole SIMD blocks with vectorised math (Sleef) and each
thread chunk's leftover tail with scalar libm, and the two disagree in the last bit for
sigmoid/silu/softplus/exp/cos/... So `sigmoid(x)[i]` depends on the tensor's length, on
i's position and on the thread count. Every canonical transcendental goes through
`pointwise`, which pads the flattened input so that every thread chunk is a multiple of
64 elements: every element then takes the vectorised path, whatever the shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Elements per block: a multiple of 2 x the widest vector (AVX-512: 16 fp32) that ATen's
# `vectorized_loop` unrolls by.
PAD_MULTIPLE = 64
# at::internal::GRAIN_SIZE, below which TensorIterator does not split work across threads.
_ATEN_GRAIN = 32768


def padded_length(n: int, num_threads: int) -> int:
    """Smallest length >= n whose ATen OpenMP thread chunks are all multiples of 64.

    ATen's `parallel_for` uses `t = min(threads, ceil(len / GRAIN))` threads with chunks of
    `ceil(len / t)`; a length that is a multiple of `64 * t` gives equal 64-aligned chunks.
    """
    p = max(PAD_MULTIPLE, -(-n // PAD_MULTIPLE) * PAD_MULTIPLE)
    while True:
        t = 1 if p < _ATEN_GRAIN else max(1, min(num_threads, -(-p // _ATEN_GRAIN)))
        q = -(-p // (PAD_MULTIPLE * t)) * (PAD_MULTIPLE * t)
        if q == p:
            return p
        p = q


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a unary elementwise `fn` so that each element's bits depend only on its value.

    On CPU the input is flattened and zero-padded (see module docstring); on other devices
    every element already runs the same code, and the padding is skipped.
    """
    if x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    flat = x.reshape(-1)
    p = padded_length(n, torch.get_num_threads())
    if p != n:
        flat = torch.nn.functional.pad(flat, (0, p - n))
    else:
        flat = flat.contiguous()
    return fn(flat)[:n].reshape(x.shape)


def exp(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.exp, x)


def log(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.log, x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.rsqrt, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.nn.functional.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.nn.functional.softplus, x)


def cos(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.cos, x)


def sin(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sin, x)
