"""Run vLLM's AsyncLLM (the engine RL frameworks embed) with IsoExec, as such a framework would:
started with `ISOEXEC=1`, the worker extension and the handshake settings in
`additional_config` (as `isoexec engine serve --handshake-*` passes them), in vLLM's default
compiled mode: every worker offers its contract as soon as it has loaded the checkpoint; once
the verdict is in (the trainer offers meanwhile), concurrent requests are generated.

`python _async_engine_job.py JOB_JSON OUT_JSON`; JOB: model, dtype, handshake {address,
token_file, run_id}, prompts, temps, n, max_tokens. OUT: verdicts and, per request, the
sampled token ids and logprobs of each sample. Run by integration/test_async_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any


async def main(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from isoexec.contract.options import VLLM_ADDITIONAL_CONFIG_KEY
    from isoexec.handshake.served import HANDSHAKE_CONFIG_KEY

    args = AsyncEngineArgs(
        model=job["model"], dtype=job["dtype"], skip_tokenizer_init=True, max_model_len=512,
        enable_prefix_caching=True, max_num_batched_tokens=64, enable_chunked_prefill=True,
        logprobs_mode="processed_logprobs", kv_cache_memory_bytes=128 * 2**20, seed=0,
        worker_extension_cls="isoexec.vllm.worker_extension.IsoWorkerExtension",
        logits_processors=["isoexec.vllm.admission:IsoAdmission"], generation_config="vllm",
        additional_config={VLLM_ADDITIONAL_CONFIG_KEY: {}, HANDSHAKE_CONFIG_KEY: job["handshake"]},
    )  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    try:
        for _ in range(600):  # the workers offered at load; their verdicts come with the trainer's
            verdicts = await engine.collective_rpc("isoexec_gate_status")
            if all(v["last_verdict"] is not None for v in verdicts):
                break
            await asyncio.sleep(0.5)

        async def one(i: int) -> list[tuple[list[int], list[float]]]:
            params = SamplingParams(temperature=job["temps"][i], max_tokens=job["max_tokens"],
                                    n=job["n"], logprobs=0,
                                    output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
            final = None
            async for out in engine.generate({"prompt_token_ids": job["prompts"][i]}, params,
                                             request_id=f"req-{i}"):  # fmt: skip
                final = out
            assert final is not None
            return [
                (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids,
                                                                     strict=True)])
                for c in sorted(final.outputs, key=lambda c: c.index)
            ]  # fmt: skip

        samples = await asyncio.gather(*(one(i) for i in range(len(job["prompts"]))))
        return {"verdicts": [{"outcome": v["last_verdict"]} for v in verdicts],
                "samples": samples}  # fmt: skip
    finally:
        engine.shutdown()


if __name__ == "__main__":
    job_file, out_file = sys.argv[1], sys.argv[2]
    result = asyncio.run(main(json.loads(Path(job_file).read_text())))
    Path(out_file).write_text(json.dumps(result))
