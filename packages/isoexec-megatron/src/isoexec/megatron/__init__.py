"""IsoExec trainer side: canonical ops installed into Megatron-core models.

Importing this package imports neither Megatron nor vLLM; Megatron is imported when a model is
built, and CPU shims are applied only by `apply_cpu_shims()` / `megatron_parallel()` (on CUDA,
`megatron_parallel(device="cuda")` applies only the dependency shims, `apply_dependency_shims`).
"""

from isoexec.megatron.cpu_shims import applied_cpu_shims, apply_cpu_shims
from isoexec.megatron.hf_checkpoint import CheckpointMismatchError
from isoexec.megatron.hf_config import (
    SUPPORTED_ARCHITECTURES,
    ModelArch,
    UnsupportedConfigError,
    load_hf_config,
)
from isoexec.megatron.model_builder import (
    Submodules,
    block_spec,
    build_model,
    isoexec_submodules,
    native_submodules,
)
from isoexec.megatron.offer import offer_contract
from isoexec.megatron.parallel import ParallelInfo, megatron_parallel
from isoexec.megatron.readback import (
    SiteNotFoundError,
    SiteNotInstalledError,
    read_sites,
    trainer_contract,
)
from isoexec.megatron.score_sampled import score_sampled
from isoexec.megatron.scoring import (
    is_isoexec,
    policy_logprobs,
    score,
    token_logprobs,
    train_step,
)
from isoexec.megatron.weights import (
    export_hf_weights,
    load_hf_weights,
    save_hf_checkpoint,
    save_hf_safetensors,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointMismatchError",
    "ModelArch",
    "ParallelInfo",
    "SiteNotFoundError",
    "SiteNotInstalledError",
    "Submodules",
    "UnsupportedConfigError",
    "applied_cpu_shims",
    "apply_cpu_shims",
    "block_spec",
    "build_model",
    "export_hf_weights",
    "is_isoexec",
    "isoexec_submodules",
    "load_hf_config",
    "load_hf_weights",
    "megatron_parallel",
    "native_submodules",
    "offer_contract",
    "policy_logprobs",
    "read_sites",
    "save_hf_checkpoint",
    "save_hf_safetensors",
    "score",
    "score_sampled",
    "token_logprobs",
    "train_step",
    "trainer_contract",
]
