"""HF safetensors checkpoint files: read one (single file or sharded with an index), write one
in the layout of another.

Writing "like" a source keeps everything the trainer does not own: the source's shard split and
index, its config and tokenizer files, and the tensors of parts the text model does not run
(a vision tower, MTP weights), byte for byte. So a trained Qwen3.5 vision-language checkpoint
stays a complete release-layout checkpoint that vLLM (or transformers) loads as before.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointMismatchError(ValueError):
    """The HF checkpoint does not fit the Megatron model (missing/unexpected keys, shapes)."""


def safetensors_files(ckpt_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards, or the single file."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: Mapping[str, str] = json.load(f)["weight_map"]
        files = [ckpt_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    single = ckpt_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    return files


def read_hf_state_dict(ckpt_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint dir (single file or sharded with an index)."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(Path(ckpt_dir)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise CheckpointMismatchError(f"tensor {key!r} appears in two shards")
                out[key] = f.get_tensor(key)
    return out


def write_like(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    source_dir: str | os.PathLike[str],
    *,
    keep_prefixes: tuple[str, ...],
) -> Path:
    """Write `tensors` as a checkpoint shaped like `source_dir`: same shard files and index,
    same non-weight files; source tensors under `keep_prefixes` are copied unchanged.

    Refuses (CheckpointMismatchError, before writing anything) a source tensor that is neither
    in `tensors` nor kept, and a tensor in `tensors` the source does not have.
    """
    src, out = Path(source_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise ValueError(f"refusing to overwrite the source checkpoint {src}")
    files = safetensors_files(src)
    layout: dict[Path, list[str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            layout[path] = list(f.keys())
    source_names = {n for names in layout.values() for n in names}
    kept = {n for n in source_names if n.startswith(keep_prefixes)}
    orphans = sorted(source_names - kept - set(tensors))
    extra = sorted(set(tensors) - source_names)
    if orphans or extra:
        raise CheckpointMismatchError(
            f"cannot write like {src}: source tensors neither exported nor kept {orphans[:10]} "
            f"({len(orphans)}), exported tensors the source lacks {extra[:10]} ({len(extra)})"
        )
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():  # config, tokenizer, generation config, index ...
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    for path, names in layout.items():
        shard: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                shard[name] = f.get_tensor(name) if name in kept else tensors[name]
        save_file(shard, str(out / path.name), metadata={"format": "pt"})
    return out


__all__ = [
    "INDEX_FILE",
    "CheckpointMismatchError",
    "read_hf_state_dict",
    "safetensors_files",
    "write_like",
]
