"""A dependency-free SVG line chart of the GRPO log (mean reward and ratio deviation per step).

python examples/plot_svg.py RUN_DIR/grpo_log.json docs/grpo_reward.svg
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

W, H, PAD = 520, 260, 44


def polyline(values: list[float], lo: float, hi: float, color: str) -> str:
    n = max(1, len(values) - 1)
    pts = " ".join(
        f"{PAD + i * (W - 2 * PAD) / n:.1f},{H - PAD - (v - lo) / (hi - lo) * (H - 2 * PAD):.1f}"
        for i, v in enumerate(values)
    )
    return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>'


def chart(logs: list[dict[str, float]]) -> str:
    reward = [float(x["mean_reward"]) for x in logs]
    ratio = [float(x["ratio_max_dev"]) for x in logs]
    steps = len(logs)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<text x="{PAD - 8}" y="{PAD + 4}" text-anchor="end">1</text>',
        f'<text x="{PAD - 8}" y="{H - PAD + 4}" text-anchor="end">0</text>',
        f'<text x="{W / 2}" y="{H - 10}" text-anchor="middle">GRPO step (0..{steps - 1})</text>',
        polyline(reward, 0.0, 1.0, "#1f77b4"),
        polyline(ratio, 0.0, 1.0, "#d62728"),
        f'<text x="{PAD + 8}" y="{PAD - 14}" fill="#1f77b4">mean reward</text>',
        f'<text x="{PAD + 120}" y="{PAD - 14}" fill="#d62728">max |π_train/π_rollout − 1| '
        f"(IsoExec: {max(ratio):g} at every step)</text>",
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    log = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(chart(log))
