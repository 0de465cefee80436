"""Which oneDNN calls may compute the canonical block GEMM's rows (`gemm._block_gemm`).

The canonical linear is defined as 32-row blocks, the last zero-padded, each one GEMM. oneDNN
picks its kernel and K order from the shapes and the thread count, not the values, so a call
over other rows can give the same bits; where a check on random rows has seen that, per
(shape, dtype, rows, threads), the cheaper call runs: a short last block of m rows alone
(`short_block_rows`), several whole blocks as one call (`whole_blocks_at_once`). Anywhere the
check sees other bits, the blocks run as defined. The bits are the definition's either way.
"""

from __future__ import annotations

import torch


def onednn_rows(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ W.T through oneDNN's prepacked primitive (x contiguous, any number of rows)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


# (N, K, dtype, block_rows, m, threads) -> rows the GEMM of a block holding m real rows must
# compute: m where oneDNN was seen to give those m rows the bits of the full block, else the
# full block (`short_block_rows`).
SHORT_BLOCK_ROWS: dict[tuple[int, int, torch.dtype, int, int, int], int] = {}
# A check packs a random weight of the real shape up to this many elements (a projection);
# above it (a vocabulary-sized head) it checks with the real weight.
CHECK_RANDOM_WEIGHT_MAX = 16 * 2**20


def short_block_rows(weight: torch.Tensor, packed: torch.Tensor, block_rows: int, m: int) -> int:
    """Rows to compute for a block of `m` real rows: `m`, if oneDNN gives m rows the bits
    they get inside the full zero-padded block, else `block_rows` (pad as the definition says).

    Why: a decode step of 8 sequences pays a 32-row GEMM, about 2.6x the 8-row one (#37). The
    canonical bits stay those of the padded block: a row of a oneDNN GEMM depends on which
    kernel and K order oneDNN picks, which it picks from the shapes and the thread count, not
    the values. So once per (shape, dtype, m, threads) two GEMMs on random rows, the full
    block and its first m rows, are compared bit for bit; only an exact match lets m rows run
    (measured on AMD EPYC: every m from 2 to 31 matches, m = 1 takes another kernel at some
    shapes and pads). The random weight keeps a zero or low-rank weight (a LoRA B at init)
    from passing a check its values make trivial."""
    n, k = weight.shape
    key = (n, k, weight.dtype, block_rows, m, torch.get_num_threads())
    rows = SHORT_BLOCK_ROWS.get(key)
    if rows is None:
        g = torch.Generator().manual_seed(m)
        x = torch.randn(block_rows, k, generator=g).to(weight.dtype)
        probe = _probe(weight, packed, block_rows, g)
        full = onednn_rows(x, probe)
        same = torch.equal(onednn_rows(x[:m], probe), full[:m])
        rows = SHORT_BLOCK_ROWS[key] = m if same else block_rows
    return rows


# (N, K, dtype, block_rows, blocks, threads) -> whether one oneDNN call over that many whole
# blocks was seen to give every row its own block's bits (`whole_blocks_at_once`).
WHOLE_BLOCKS_AT_ONCE: dict[tuple[int, int, torch.dtype, int, int, int], bool] = {}


def whole_blocks_at_once(
    weight: torch.Tensor, packed: torch.Tensor, block_rows: int, blocks: int
) -> bool:
    """May one GEMM over `blocks` whole blocks replace the `blocks` block GEMMs?

    Why: a prefill or a trainer's micro-batch ran its blocks as separate 32-row GEMMs, each
    streaming the whole weight again; at a 151k vocabulary the bf16 lm head over 256 rows was
    1.2x native with the packed weight cached, 1.7x without (#37). The rule is the short
    block's (`short_block_rows`): oneDNN picks its kernel and K order from the shapes and the
    thread count, not the values, so once per (shape, dtype, blocks, threads) random rows go
    through both ways and only bit-for-bit equal rows let the one call run."""
    if blocks < 2:
        return True
    n, k = weight.shape
    key = (n, k, weight.dtype, block_rows, blocks, torch.get_num_threads())
    ok = WHOLE_BLOCKS_AT_ONCE.get(key)
    if ok is None:
        g = torch.Generator().manual_seed(blocks)
        x = torch.randn(blocks * block_rows, k, generator=g).to(weight.dtype)
        probe = _probe(weight, packed, block_rows, g)
        once = onednn_rows(x, probe)
        ok = WHOLE_BLOCKS_AT_ONCE[key] = all(
            torch.equal(onednn_rows(b, probe), once[i * block_rows : (i + 1) * block_rows])
            for i, b in enumerate(x.split(block_rows))
        )
    return ok


def _probe(
    weight: torch.Tensor, packed: torch.Tensor, block_rows: int, g: torch.Generator
) -> torch.Tensor:
    """The packed weight a check runs: a random one of the real shape (so a zero or low-rank
    weight, a LoRA B at init, cannot pass a check its values make trivial), or above
    `CHECK_RANDOM_WEIGHT_MAX` elements (a vocabulary head) the real one."""
    n, k = weight.shape
    if n * k > CHECK_RANDOM_WEIGHT_MAX:
        return packed
    w = torch.randn(n, k, generator=g).to(weight.dtype)
    return torch.ops.mkldnn._reorder_linear_weight(w, block_rows)


__all__ = [
    "CHECK_RANDOM_WEIGHT_MAX",
    "SHORT_BLOCK_ROWS",
    "WHOLE_BLOCKS_AT_ONCE",
    "onednn_rows",
    "short_block_rows",
    "whole_blocks_at_once",
]
