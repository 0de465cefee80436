"""CPU shims for Megatron's transformer, MoE, RNG, tensor- and pipeline-parallel code
(`isoexec.megatron.cpu_shims` has the rules they follow)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from isoexec.megatron.patches import REGISTRY


class _TorchWithCpuCurrentDevice:
    """The `torch` module, except that `torch.cuda.current_device()` is "cpu"."""

    class _Cuda:
        @staticmethod
        def current_device() -> str:
            return "cpu"

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------
# 1. torch.compile (Megatron's `jit_fuser`)
# --------------------------------------------------------------------------------------------


def _noop_decorator(func: Callable[..., Any]) -> Callable[..., Any]:
    return func


def _unwrap_compiled(obj: Any) -> Any | None:
    """The eager function behind a `torch.compile`d one, or None if `obj` is not compiled."""
    orig = getattr(obj, "_torchdynamo_orig_callable", None)
    return orig if callable(orig) else None


def shim_disable_jit_fuser() -> None:
    """Run Megatron's `@jit_fuser` helpers eagerly.

    Why: `megatron.core.jit.jit_fuser` is `torch.compile`. On CPU that means Inductor compiling
    C++ at first call (slow, needs a compiler) and numerics that differ from the eager ops IsoExec
    reasons about. We undo it only inside Megatron: the `jit_fuser` name in every loaded
    `megatron.core.*` module becomes a no-op decorator (for helpers decorated at run time, e.g.
    inside `experts.py`), and functions/methods already compiled at import are replaced by their
    eager originals. `TORCHDYNAMO_DISABLE=1` is *not* set globally, because that would also switch
    off `torch.compile` for anything else in the process (vLLM in an integration test).

    Re-running it is cheap and covers Megatron modules imported since the last run.
    """
    import megatron.core.jit as mjit

    REGISTRY.set_attr(mjit, "jit_fuser", _noop_decorator)
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("megatron.core"):
            continue
        mdict = vars(mod)
        if mdict.get("jit_fuser") is not None and mdict["jit_fuser"] is not _noop_decorator:
            REGISTRY.set_attr(mod, "jit_fuser", _noop_decorator)
        for attr, val in list(mdict.items()):
            orig = _unwrap_compiled(val)
            if orig is not None:
                REGISTRY.set_attr(mod, attr, orig)
            elif isinstance(val, type) and val.__module__ == name:
                for cattr, cval in list(vars(val).items()):
                    corig = _unwrap_compiled(cval)
                    if corig is not None:
                        REGISTRY.set_attr(val, cattr, corig)


# --------------------------------------------------------------------------------------------
# 2. RoPE: RotaryEmbedding.get_emb moves inv_freq to CUDA
# --------------------------------------------------------------------------------------------


def shim_rotary_embedding_stays_on_cpu() -> None:
    """Replace `RotaryEmbedding.get_emb` with the 0.16.1 body minus the move to CUDA.

    Why: upstream does `self.inv_freq = self.inv_freq.to(torch.cuda.current_device())` the first
    time it sees a CPU `inv_freq`; on a CPU-only torch that raises. The frequencies themselves are
    computed exactly as upstream (same `get_freqs_non_repeated`, same concatenation).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_emb(self: RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]

    get_emb.__doc__ = RotaryEmbedding.get_emb.__doc__
    REGISTRY.set_attr(RotaryEmbedding, "get_emb", get_emb)


# --------------------------------------------------------------------------------------------
# 3. Global memory buffer (used by DotProductAttention for the score matrix)
# --------------------------------------------------------------------------------------------


def shim_global_memory_buffer_on_cpu() -> None:
    """Make `GlobalMemoryBuffer.get_tensor` allocate on the CPU.

    Why: `DotProductAttention` takes its `baddbmm` output buffer from the global memory buffer,
    which allocates with `device=torch.cuda.current_device()`. Same caching logic as upstream.
    """
    from functools import reduce
    from operator import mul

    from megatron.core.utils import GlobalMemoryBuffer

    def get_tensor(
        self: GlobalMemoryBuffer,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        required_len = reduce(mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required_len:
            ctx = mem_alloc_context if mem_alloc_context else contextlib.nullcontext
            with ctx():
                self.buffer[(name, dtype)] = torch.empty(
                    required_len, dtype=dtype, device="cpu", requires_grad=False
                )
        return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)

    REGISTRY.set_attr(GlobalMemoryBuffer, "get_tensor", get_tensor)


# --------------------------------------------------------------------------------------------
# 4. Default causal / sliding-window masks
# --------------------------------------------------------------------------------------------


def shim_causal_masks_on_cpu() -> None:
    """Build the default causal (and sliding-window) attention masks on the CPU.

    Why: `transformer/utils.py` creates them with `device="cuda"`; `FusedScaleMaskSoftmax`'s
    torch fallback calls them (imported by name into `fusions/fused_softmax.py`) whenever no
    explicit mask is passed. Same masks, CPU device; both bindings are replaced.
    """
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as tutils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """Return the causal upper triangular mask for softmax input (CPU)."""
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    def get_sliding_window_causal_mask(sq: int, skv: int, window_size: Any) -> torch.Tensor:
        """The SWA mask in [sq, skv] shape (CPU)."""
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
        return ~ml

    for mod in (tutils, fused_softmax):
        REGISTRY.set_attr(mod, "get_default_causal_mask", get_default_causal_mask)
        REGISTRY.set_attr(mod, "get_sliding_window_causal_mask", get_sliding_window_causal_mask)


# --------------------------------------------------------------------------------------------
# 5. MoE router gating moves its weight to CUDA
# --------------------------------------------------------------------------------------------


def shim_router_gating_on_cpu() -> None:
    """Replace `Router.gating` with the 0.16.1 body minus the move of weight/bias to CUDA.

    Why: upstream moves a CPU router weight to `torch.cuda.current_device()` at the first
    forward. The logits are computed by the same `router_gating_linear` with the same
    `moe_router_dtype` handling. (Buffers for expert bias / global aux loss are also created on
    CUDA in `TopKRouter.__init__`; `model_builder` refuses configs that would need them.)
    """
    from megatron.core.transformer.moe import router as router_mod

    def gating(self: router_mod.Router, input: torch.Tensor) -> torch.Tensor:
        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        return router_mod.router_gating_linear(input, self.weight, self.bias, router_dtype)

    gating.__doc__ = router_mod.Router.gating.__doc__
    REGISTRY.set_attr(router_mod.Router, "gating", gating)


# --------------------------------------------------------------------------------------------
# 6. MoE: `te_general_gemm` is referenced without being defined when TE is absent
# --------------------------------------------------------------------------------------------


def shim_moe_utils_without_te() -> None:
    """Define `moe_utils.te_general_gemm = None` so the router's torch matmul path is taken.

    Why: `RouterGatingLinearFunction` tests `if te_general_gemm is not None`, but the name is
    only bound when Transformer Engine imports; without TE the test raises `NameError`. `None`
    is exactly the value the code expects for "no TE".
    """
    from megatron.core.transformer.moe import moe_utils

    if getattr(moe_utils, "HAVE_TE", False):
        raise RuntimeError("moe_utils.HAVE_TE is True: this shim is only for a TE-less install")
    if not hasattr(moe_utils, "te_general_gemm"):
        REGISTRY.set_attr(moe_utils, "te_general_gemm", None, must_exist=False)


# --------------------------------------------------------------------------------------------
# 7. RNG: model_parallel_cuda_manual_seed / CudaRNGStatesTracker need CUDA
# --------------------------------------------------------------------------------------------


def _cpu_rng_tracker_class() -> type:
    from megatron.core.tensor_parallel.random import (
        _MODEL_PARALLEL_RNG_TRACKER_NAME,
        CudaRNGStatesTracker,
    )

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's RNG tracker over the CPU generator: same names, same fork semantics.

        Why: dropout regions (`get_cuda_rng_tracker().fork()`) must draw from per-parallel-rank
        streams as on GPU, but the upstream tracker stores `torch.cuda` RNG states.
        """

        def __init__(self) -> None:
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """CPU replacement for `tensor_parallel.model_parallel_cuda_manual_seed`.

    Why: the upstream function calls `torch.cuda.manual_seed` and stores CUDA RNG states. This
    seeds the CPU generator with the data-parallel seed and installs a CPU tracker holding the
    same three named streams (data-parallel, model-parallel with `+2718+tp_rank`, expert-parallel)
    derived exactly as upstream. Call it after parallel_state is initialised.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    tracker = _cpu_rng_tracker_class()()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def reset_cpu_rng_tracker() -> None:
    """Forget the seeded RNG tracker when a parallel state ends.

    Why: Megatron keeps its tracker in module globals and offers no reset; a later
    `megatron_parallel()` in the same process must start from a fresh, freshly seeded one
    (`model_parallel_cpu_manual_seed`), not inherit the old streams.
    """
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def shim_cpu_rng_tracker() -> None:
    """Point `tensor_parallel.random.model_parallel_cuda_manual_seed` at the CPU version.

    Why: callers written for GPU (and Megatron's own helpers) seed through that name; on CPU it
    raises. The module attribute and the re-export in `megatron.core.tensor_parallel` are both
    replaced by `model_parallel_cpu_manual_seed` (the extra keyword arguments for TE/cuda-graph
    trackers are refused rather than ignored).
    """
    import megatron.core.tensor_parallel as tp_pkg
    from megatron.core.tensor_parallel import random as mrandom

    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        extra = [a for a in args if a] + [k for k, v in kwargs.items() if v]
        if extra:
            raise NotImplementedError(
                f"model_parallel_cuda_manual_seed on CPU supports only the seed; got {extra}"
            )
        model_parallel_cpu_manual_seed(seed)

    REGISTRY.set_attr(mrandom, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed)
    REGISTRY.set_attr(tp_pkg, "model_parallel_cuda_manual_seed", model_parallel_cuda_manual_seed)


# --------------------------------------------------------------------------------------------
# 8. Tensor- and expert-parallel mappings (TP>1, EP>1 over gloo)
# --------------------------------------------------------------------------------------------


def shim_tp_mappings_on_cpu() -> None:
    """Let Megatron's tensor-parallel communication mappings allocate on the CPU.

    Why: at TP>1 the gathered output of a column-parallel layer (the lm head's vocab, the
    TP-invariant linear's leaves), and at EP>1 the expert exchange's all-gather and
    reduce-scatter over the expert group, are allocated with
    `device=torch.cuda.current_device()`. Only the `torch` global of
    `megatron.core.tensor_parallel.mappings` is replaced, by a view of torch whose
    `cuda.current_device()` is "cpu"; the collectives and every other attribute are upstream's.
    """
    from megatron.core.tensor_parallel import mappings

    if not isinstance(mappings.torch, _TorchWithCpuCurrentDevice):
        REGISTRY.set_attr(mappings, "torch", _TorchWithCpuCurrentDevice())


# --------------------------------------------------------------------------------------------
# 11. Pipeline parallelism (PP>1 over gloo): p2p buffers and the schedule's token counter
# --------------------------------------------------------------------------------------------


class _TorchForCpuPipeline(_TorchWithCpuCurrentDevice):
    """`_TorchWithCpuCurrentDevice`, plus `torch.zeros(..., device="cuda")` made on the CPU."""

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def shim_pipeline_on_cpu() -> None:
    """Let Megatron's pipeline schedules and p2p communication run on CPU tensors.

    Why: `P2PCommunicator` allocates its receive buffers (and the shape messages of variable
    sequence lengths) with `device=torch.cuda.current_device()`, and the 1F1B / no-pipelining
    schedules count tokens in `torch.zeros([], device="cuda")`. Only the `torch` global of
    `megatron.core.pipeline_parallel.{p2p_communication,schedules}` is replaced, by a view of
    torch whose `cuda.current_device()` is "cpu" and whose `zeros` maps a CUDA device to the
    CPU; every other attribute is torch's own. The tensors sent are the model's, unchanged.
    """
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    for mod in (p2p, schedules):
        if not isinstance(mod.torch, _TorchForCpuPipeline):
            REGISTRY.set_attr(mod, "torch", _TorchForCpuPipeline())
