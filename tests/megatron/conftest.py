"""Fixtures for the trainer side: tiny random-weight HF checkpoints made locally, and a
Megatron parallel state per test (created and destroyed around each test, so no process group
outlives it).

Weights are randomised well beyond HF's init (norm weights ≠ 1, std 0.15 elsewhere) so that a
wrong mapping (q/k norm, gate/up order, QKV grouping) changes the logprobs visibly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != hidden / heads (16)
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _make_checkpoint(path: Path, config: object, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config

    cfg = Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return _make_checkpoint(tmp_path_factory.mktemp("qwen3"), cfg, seed=1)


@pytest.fixture(scope="session")
def qwen3_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3Config

    cfg = Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return _make_checkpoint(tmp_path_factory.mktemp("qwen3_tied"), cfg, seed=2)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 experts, top-2, renormalised top-k; layer 1 dense via mlp_only_layers."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return _make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), cfg, seed=3)


@pytest.fixture(scope="session")
def qwen3_moe_nonorm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """norm_topk_prob=False and decoder_sparse_step=2 (layers 1, 3 sparse)."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=4,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return _make_checkpoint(tmp_path_factory.mktemp("qwen3_moe_nonorm"), cfg, seed=4)


@pytest.fixture
def parallel() -> Iterator[object]:
    """Megatron parallel state (gloo, world size 1) for one test; destroyed afterwards."""
    import torch.distributed as dist

    from isoexec.megatron.parallel import megatron_parallel

    with megatron_parallel(seed=1234) as info:
        yield info
    assert not dist.is_initialized(), "process group leaked past megatron_parallel()"


@pytest.fixture(scope="session")
def sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 9, 33)]
