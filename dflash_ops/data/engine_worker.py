"""One regeneration engine in a process of its own:
`PYTHON -m dflash_ops.data.engine_worker --engine vllm --target DIR [...]`, started by `dflash_ops.data
regenerate`.

Reads requests on stdin, one JSON line each, `{"id": <prompt index>, "prompt": [token ids], "max_tokens":
N, "seed": S}` (end of input: no more), and writes on stdout `{"id": ..., "response": [token ids]}` for each
as it finishes, in the order they finish: `{"event": "ready"}` first, once the engine is built, and
`{"event": "done"}` last, once every request is answered. The
engine's own log goes to stderr, and so does what it prints on stdout. A request the engine refuses is
answered `{"id": ..., "skipped": reason}`.

- `vllm`: vLLM's offline engine (`vllm.LLM`, continuous batching over a paged KV cache), stepped by hand
  through `LLM.llm_engine` (`add_request`, `step`) so that an answer is written when its request ends,
  not when the last of a batch does; at most `--window` requests are in the engine at once, the rest wait
  on stdin (memory bounded whatever the prompt count). Runs in vLLM's own venv: this module imports
  nothing of the trainer for it, and the parent puts the code's root on PYTHONPATH.
- `hf`: transformers' `generate` on static batches of `--batch-size` (`dflash_ops.data.regenerate`'s
  batches), answers written per batch: the same protocol without vLLM.

Greedy at temperature 0, else sampled with the request's seed (vLLM on a GPU: per request, so an answer
does not depend on what it was batched with; on CPU vLLM takes none, and its engine's seed is the one).
The answer ends with the target's end of text (kept) or after `max_tokens`. SIGTERM ends the process:
what it has written is kept by the parent, the rest is asked again by the next call.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading

END = None  # what the stdin reader queues at the end of input
RESULTS = sys.stdout  # main() makes it a copy of stdout, and stdout the log (engines print there)


def read_requests(stream, into: queue.Queue) -> None:
    """Queue each request of `stream`, then END (a thread: the engine steps while the parent writes)."""
    for line in stream:
        if line.strip():
            into.put(json.loads(line))
    into.put(END)


def emit(record: dict) -> None:
    RESULTS.write(json.dumps(record) + "\n")
    RESULTS.flush()


def run_vllm(args, requests: queue.Queue) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_length, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
              disable_log_stats=True)
    engine = llm.llm_engine
    # vLLM's CPU sampler takes no seed per request ("CPU Generator does not use offset"): there the engine's
    # seed alone makes a sampled run repeatable, given the same prompts in the same order.
    seeded = args.temperature > 0 and not current_platform.is_cpu()
    emit({"event": "ready"})
    inflight: dict[str, int] = {}
    more = True
    while more or inflight:
        # Top the engine up to the window; block for input only when it has nothing to do.
        while more and len(inflight) < args.window:
            try:
                request = requests.get(block=not inflight)
            except queue.Empty:
                break
            if request is END:
                more = False
                break
            params = SamplingParams(max_tokens=request["max_tokens"], temperature=args.temperature,
                                    top_p=args.top_p, seed=request["seed"] if seeded else None)
            try:
                # Outputs carry the id given here (the engine's own, returned, has a suffix).
                engine.add_request(str(request["id"]), TokensPrompt(prompt_token_ids=request["prompt"]),
                                   params)
            except ValueError as err:  # vLLM's input validation (a prompt over max_model_len, say)
                emit({"id": request["id"], "skipped": str(err)})
                continue
            inflight[str(request["id"])] = request["id"]
        if not inflight:
            continue
        for output in engine.step():
            if output.finished:
                emit({"id": inflight.pop(output.request_id), "response": list(output.outputs[0].token_ids)})


def run_hf(args, requests: queue.Queue) -> None:
    import torch

    from dflash_ops.data.chat_prompts import GenerationSettings, load_tokenizer
    from dflash_ops.data.regenerate import end_of_text_ids, generate_batch
    from dflash_ops.data.target import load_target

    model = load_target(args.target, args.dtype, args.device)
    tokenizer = load_tokenizer(args.target)
    eos, pad = end_of_text_ids(model, tokenizer)
    emit({"event": "ready"})
    more = True
    while more:
        batch = []
        while len(batch) < args.batch_size:
            request = requests.get()
            if request is END:
                more = False
                break
            batch.append(request)
        if not batch:
            break
        torch.manual_seed(batch[0]["seed"])
        # One bound for the batch, as the in-process path's: the longest prompt's.
        settings = GenerationSettings(min(r["max_tokens"] for r in batch), len(batch), args.temperature,
                                      args.top_p)
        for request, response in zip(batch, generate_batch(model, [r["prompt"] for r in batch], settings,
                                                           eos, pad), strict=True):
            emit({"id": request["id"], "response": response})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ops.data.engine_worker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "hf"), required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-length", type=int, required=True, help="prompt + answer limit")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--window", type=int, default=1024, help="most requests in the engine at once")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM: no CUDA graphs")
    parser.add_argument("--batch-size", type=int, default=8, help="hf: prompts answered together")
    parser.add_argument("--device", default="cpu", help="hf: the torch device")
    args = parser.parse_args(argv)
    global RESULTS
    RESULTS = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what vLLM logs to stdout goes to the log
    requests: queue.Queue = queue.Queue(maxsize=max(2 * args.window, 2 * args.batch_size))
    threading.Thread(target=read_requests, args=(sys.stdin, requests), daemon=True).start()
    (run_vllm if args.engine == "vllm" else run_hf)(args, requests)
    emit({"event": "done"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
