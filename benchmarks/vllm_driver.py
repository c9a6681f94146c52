"""Greedy decoding of token prompts through vLLM's offline API, with or without a DFlash drafter.

    <serve venv>/bin/python benchmarks/vllm_driver.py REQUEST.json RESULT.json

Runs in the venv of `make serve-check` (scripts/serve_venv.py) and imports nothing of this project:
vLLM reads the target and the export as any user's would. REQUEST.json:
`{"target": DIR, "drafter": DIR or null, "num_speculative_tokens": K, "prompts": [[ids]],
"max_new_tokens": N, "dtype": "float32", "max_model_len": L, "repeats": R}`. RESULT.json: the
generated token ids of each prompt, the speculative decoding counters of `llm.get_metrics()`
(drafts, draft tokens, accepted tokens, accepted per draft position) over one `generate` call of
all prompts (after a short warm-up request), and the seconds of the fastest of R such calls.
The work is under `if __name__ == "__main__"`: vLLM starts its engine in a spawned process.
"""

import json
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
            "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_decode_counters(metrics) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    found = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for metric in metrics:
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            found[COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            found["accepted_per_position"] = list(metric.values)
    return found


def counters_since(before: dict, after: dict) -> dict:
    per_position = after["accepted_per_position"]
    earlier = before["accepted_per_position"] or [0] * len(per_position)
    return {**{name: after[name] - before[name] for name in COUNTERS.values()},
            "accepted_per_position": [a - b for a, b in zip(per_position, earlier, strict=True)]}


def generate(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if request.get("drafter"):
        speculative = {"method": "dflash", "model": request["drafter"],
                       "num_speculative_tokens": request["num_speculative_tokens"]}
    llm = LLM(model=request["target"], speculative_config=speculative, dtype=request["dtype"],
              max_model_len=request["max_model_len"], enforce_eager=True, seed=0,
              disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    # A first request warms the engine up; its drafts are subtracted from the counters.
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    before = spec_decode_counters(llm.get_metrics())
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = [time.perf_counter() - started]
    counters = counters_since(before, spec_decode_counters(llm.get_metrics()))
    for _ in range(request.get("repeats", 1) - 1):  # the same call again, timed only
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    return {"outputs": [list(out.outputs[0].token_ids) for out in outputs], "seconds": min(seconds),
            "spec_decode": counters}


if __name__ == "__main__":
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as fh:
        result = generate(json.load(fh))
    with open(result_path, "w") as fh:
        json.dump(result, fh)
