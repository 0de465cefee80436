"""A stand-in for an RL framework's own vLLM worker extension (as SkyRL's or veRL's): it
updates weights its own way, straight into the model's `load_weights`."""

from __future__ import annotations

from typing import Any

from isoexec.vllm.worker_extension import compose


class FrameworkExtension:
    model_runner: Any

    def framework_ping(self) -> str:
        return "pong"

    def update_weights_from_tensors(self, named: list[tuple[str, Any]]) -> int:
        self.model_runner.model.load_weights(iter(named))
        return len(named)


Extension = compose(FrameworkExtension)
