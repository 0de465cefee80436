"""Rollouts on vLLM's `AsyncLLM` with weight pushes landing mid-generation, as an asynchronous
RL framework drives it (veRL's and SkyRL's async engines are `AsyncLLM`s). Run as its own
process (`python _async_rollouts.py SPEC OUT`, in its own session: the test kills its group).

SPEC (JSON): model, handshake (`ServedHandshake` settings), prompts_a, prompts_b, late
(prompts sent while the first push drains), max_tokens, pushes [[file, fingerprint], x2].

- Phase A, protected: the prompts_a streams generate through `WeightVersions.generate`; once
  every one has a token, `WeightVersions.push` loads push 1; `late` streams start meanwhile.
- Phase B, unprotected (the negative control): the prompts_b streams generate through plain
  `AsyncLLM.generate`; once every one has a token, push 2 is loaded with a bare
  `collective_rpc("isoexec_load_weights")`, as a framework that calls the worker directly does.

OUT (JSON): per phase, per stream: the version and fingerprint it reports (phase A), its token
ids, their logprobs, and how many tokens it had when the push began.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

from isoexec.vllm.engine_kwargs import isoexec_engine_kwargs
from isoexec.vllm.weight_versions import WeightVersions


async def _until_matched(engine: Any) -> None:
    for _ in range(600):
        status = await engine.collective_rpc("isoexec_gate_status")
        if all(s["last_verdict"] == "MATCH" for s in status):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no MATCH in 120 s: {status}")


async def _stream(
    outputs: Any, started: asyncio.Event, push_began: asyncio.Event, out: dict[str, Any]
) -> None:
    async for item in outputs:
        versioned = hasattr(item, "weights_version")
        completion = (item.output if versioned else item).outputs[0]
        if versioned:
            out["version"], out["fingerprint"] = item.weights_version, item.fingerprint
        out["ids"] = list(completion.token_ids)
        steps = zip(out["ids"], completion.logprobs, strict=True)
        out["logprobs"] = [s[t].logprob for t, s in steps]
        if not push_began.is_set():
            out["before_push"] = len(out["ids"])
        if out["ids"]:
            started.set()


async def _phase(
    engine: Any,
    versions: WeightVersions | None,
    prompts: list[list[int]],
    late: list[list[int]],
    params: Any,
    push: Any,
) -> list[dict[str, Any]]:
    from vllm.inputs import TokensPrompt

    push_began = asyncio.Event()
    results: list[dict[str, Any]] = []

    def start(prompt: list[int]) -> tuple[asyncio.Task[None], asyncio.Event]:
        rid = f"rollout-{uuid.uuid4().hex}"
        tp = TokensPrompt(prompt_token_ids=prompt)
        gen = (engine.generate(tp, params, rid) if versions is None
               else versions.generate(engine, tp, params, rid))  # fmt: skip
        out: dict[str, Any] = {"prompt": prompt, "before_push": 0}
        results.append(out)
        started = asyncio.Event()
        return asyncio.create_task(_stream(gen, started, push_began, out)), started

    first = [start(p) for p in prompts]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for _, e in first)), 300)
    push_began.set()
    pushing = asyncio.create_task(push())
    await asyncio.sleep(0)  # the push has closed admission before the late requests arrive
    later = [start(p) for p in late]
    await asyncio.wait_for(asyncio.gather(pushing, *(t for t, _ in first + later)), 600)
    return results


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = isoexec_engine_kwargs(handshake=spec["handshake"])
    args = AsyncEngineArgs(
        model=spec["model"], dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=512, kv_cache_memory_bytes=256 * 2**20, seed=0,
        generation_config="vllm", **kwargs,
    )  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    try:
        await _until_matched(engine)
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, logprobs=0,
                                detokenize=False, ignore_eos=True)  # fmt: skip
        versions = WeightVersions()
        (file1, fp1), (file2, fp2) = spec["pushes"]
        a = await _phase(engine, versions, spec["prompts_a"], spec["late"], params,
                         lambda: versions.push(engine, file1, fp1))  # fmt: skip

        async def bare_push() -> None:
            await engine.collective_rpc("isoexec_load_weights", args=(file2, fp2, False))

        b = await _phase(engine, None, spec["prompts_b"], [], params, bare_push)
        return {"a": a, "b": b, "fingerprint_after_a": versions.fingerprint}
    finally:
        engine.shutdown()


if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        result = asyncio.run(main(json.load(f)))
    with open(out_path, "w") as f:
        json.dump(result, f)
