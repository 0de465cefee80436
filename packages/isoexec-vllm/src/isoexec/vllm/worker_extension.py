"""vLLM worker extension (`worker_extension_cls`): IsoExec's per-worker RPC surface.

Called through `LLM.collective_rpc("isoexec_…")`; every name is prefixed so it cannot clash
with the worker's own attributes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from isoexec.vllm.readback import read_sites

QUALNAME = "isoexec.vllm.worker_extension.IsoWorkerExtension"


class IsoWorkerExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def _isoexec_hf_config(self) -> dict[str, Any]:
        path = Path(self.model_runner.model_config.model) / "config.json"
        return json.loads(path.read_text())

    def isoexec_sites(self) -> list[tuple[str, tuple[Any, ...]]]:
        """(site, ImplInfo fields) for every site, as plain tuples (they cross processes)."""
        from dataclasses import astuple

        sites = read_sites(
            self.model_runner.model, self.model_runner.sampler, self._isoexec_hf_config()
        )
        return [(name, astuple(impl)) for name, impl in sites.items()]
