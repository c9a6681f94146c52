"""Training data from a prompt set, answered by the target itself:
`python -m dflash_ops.data regenerate --target DIR --prompts PROMPTS.jsonl --out TRAIN.jsonl`.

A drafter learns to predict the target, so its training responses are the target's own (the
paper regenerates every response). `--engine vllm` answers on vLLM's engine in processes of its own venv
(`dflash_ops.data.regenerate_engine`, docs/PIPELINE.md); this module holds the command, the resume and
provenance rules every engine shares, and the transformers path (`--engine hf`) described here.
Each prompt line is a chat, `{"messages": [{"role", "content"}, ...]}` or the bare list, or ShareGPT's or
SpecForge's `{"conversations": [...]}`; parquet and Arrow prompt sets too (`dflash_ops.data.chat_formats`,
which refuses anything else naming the formats); a trailing assistant message is dropped (its answer is
what is regenerated). `--turns all` answers (and scores) every assistant turn of a chat in order, in
process (`dflash_ops.data.regenerate_turns`); `--turns last`, the default, the chat's end alone.
The chat goes through the target tokenizer's chat template with the generation prompt, the target
answers in batches (left-padded; greedy, or sampled with `--temperature`/`--top-p`), and each row
of the output is `{"id": <prompt line index>, "input_ids": chat + response, "loss_mask": 0 on the
chat, 1 on the response}`, the format `dflash_ops.train` reads. A response ends with the first end of
text (kept) or after `--max-new-tokens`.

Thinking mode: a chat template that takes `enable_thinking` (its text names it, as Qwen3's does)
is given `--enable-thinking` (default false: the public Qwen3 DFlash drafters are non-thinking,
and a drafter trained in the other mode than it is served in accepts far fewer tokens). A template
without the toggle is given nothing and the mode recorded is null; `--enable-thinking true` for it
is an error, before any model is loaded.

Resumable: rows go to `<out>.part-<r>` as each batch finishes; a second call skips the prompts that
have a row (in the parts or in `<out>`), then writes `<out>` (every row, by id) atomically, removes
the parts and writes `<out>.manifest.json` (`dflash_ops.data.data_manifest`: the target, the prompts,
the mode, the settings, the rows; atomically too). A line cut short by a kill is dropped.
SIGTERM (or SIGINT) stops the replicas between two batches: the rows written stay in the parts, nothing is
merged, a `stopped` line says how many prompts have their row, and the call exits 0; the same command goes
on. A `progress` line (rows written, of, rows/s, ETA) comes every `--progress-every` rows.
With `--device cuda` each visible GPU runs one replica of the target on every n-th prompt; on CPU
(`--replicas`, default 1) the same.

Rows of two settings never mix either: a call that would resume from rows made with another target,
prompt file, --max-new-tokens, --temperature, --top-p, --seed, --max-length, --dtype or --turns is refused,
naming each difference, so the manifest always names the settings its rows were made with.

Rows of two thinking modes never mix. A call records its mode in `<out>.parts.json` before it
generates anything and removes that record last, after the manifest, once no part is left; so the
mode of every row already there is the record's while it exists, else `<out>`'s manifest's. A call
that would resume from rows (in `<out>` or its parts) of another mode is refused, and so is one
that finds rows whose mode nothing records (a file from elsewhere: move it away to start over).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from dflash_ops.core.config import load_config, local_model_problem, target_text_config
from dflash_ops.core.runtime import StopSignal
from dflash_ops.data.chat_prompts import (  # noqa: F401 (PromptError, read_rows: this module's API too)
    GenerationSettings,
    PendingPrompts,
    PromptError,
    answer_bound,
    complete_rows,
    load_tokenizer,
    part_path,
    parts,
    read_chats,
    read_rows,
)
from dflash_ops.data.data_manifest import FORMAT, manifest_path, mode_name, read_record
from dflash_ops.data.feature_cache import write_json
from dflash_ops.data.generation import (  # noqa: F401 (DEFAULT_MAX_LENGTH, template_takes_thinking: API too)
    DEFAULT_MAX_LENGTH,
    ThinkingModeError,
    end_of_text_ids,
    generate_batch,
    template_takes_thinking,
    thinking_mode,
)
from dflash_ops.data.row_merge import merge_rows
from dflash_ops.data.target import DTYPES, load_target


class ProvenanceError(ValueError):
    """The rows the call would resume from were made with other settings than the call's."""


def parts_record_path(out: str | Path) -> Path:
    """`<out>.parts.json`: the record of an unfinished regeneration (its mode above all)."""
    out = Path(out)
    return out.with_name(f"{out.name}.parts.json")


# The settings a row's answer depends on, beside the thinking mode: a resume under others is refused.
ANSWER_SETTINGS = ("max_new_tokens", "temperature", "top_p", "seed", "max_length", "dtype", "turns")


def provenance_changes(rows: dict, call: dict) -> dict[str, tuple]:
    """{setting: (the rows', this call's)} where the record `rows` was written with other settings than
    `call`'s: the target and the prompts (as resolved paths) and the ANSWER_SETTINGS. A setting the
    rows' record lacks (written before it was recorded) is not compared."""
    changes = {}
    for key in ("target", "prompts"):
        if key in rows and Path(rows[key]).resolve() != Path(call[key]).resolve():
            changes[key] = (rows[key], call[key])
    theirs, ours = rows.get("generation") or {}, call["generation"]
    for key in ANSWER_SETTINGS:
        if key in theirs and theirs[key] != ours[key]:
            changes[key] = (theirs[key], ours[key])
    return changes


def check_resume(out: Path, call: dict) -> None:
    """Refuse to resume from rows (in `out` or its parts) of another thinking mode than this call's record
    `call` gives, or of one nothing records; or made with other settings (`provenance_changes`)."""
    mode = call["enable_thinking"]
    holders = [path for path in [out, *parts(out)] if next(complete_rows(path), None)]
    if not holders:
        return
    record = read_record(parts_record_path(out)) or read_record(manifest_path(out))
    names = ", ".join(map(str, holders))
    if record is None:
        raise ThinkingModeError(f"{names} hold rows whose thinking mode nothing records (no "
                                f"{parts_record_path(out).name} or {manifest_path(out).name}); rows of two "
                                "modes must not mix: move them away to start over")
    theirs = record["enable_thinking"]
    if theirs != mode:
        how = "a template without the toggle" if theirs is None else f"--enable-thinking {mode_name(theirs)}"
        raise ThinkingModeError(f"{names} hold rows regenerated with enable_thinking {mode_name(theirs)}, "
                                f"this call's is {mode_name(mode)}; rows of two modes must not mix: resume "
                                f"with {how}, or move them away to start over")
    changes = provenance_changes(record, call)
    if changes:
        listed = "; ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
        raise ProvenanceError(f"{names} hold rows regenerated with other settings than this call's: {listed} "
                              "(the rows' -> this call's); their manifest would name settings they were not "
                              "made with: resume with the rows' settings, or move them away (or write to "
                              "another --out) to start over")


def run_replica(replica: int, replicas: int, target_path: str, prompts_path: str, out: str, device: str,
                dtype: str, settings: GenerationSettings, max_length: int, progress: bool,
                mode: bool | None = None, progress_every: int = 0, turns: str = "last",
                stop: StopSignal | None = None) -> dict:
    """Answer the prompts `replica::replicas` that have no row yet, the template given `mode` as its
    enable_thinking (None: nothing); a `progress` line on stdout each time `progress_every` more rows are
    written (0: none); stop between two batches once `stop` is requested. Returns counts. `turns` all:
    every assistant turn of each chat (`dflash_ops.data.regenerate_turns`)."""
    from tqdm import tqdm

    if turns == "all":
        from dflash_ops.data.regenerate_turns import run_all_turns

        return run_all_turns(replica, replicas, target_path, prompts_path, out, device, dtype, settings,
                             max_length, mode, stop, load_model=load_target)

    out_path = Path(out)
    tokenizer = load_tokenizer(target_path)
    chats = read_chats(prompts_path)
    part = part_path(out_path, replica)
    done = set(read_rows(out_path)) | set(read_rows(part))
    pending = PendingPrompts(tokenizer, chats, mode, max_length)
    todo = list(pending.prompts(index for index in range(replica, len(chats), replicas) if index not in done))
    too_long = pending.too_long
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model = load_target(target_path, dtype, device)
    eos, pad = end_of_text_ids(model, tokenizer)
    bar = tqdm(total=len(todo), desc=f"replica {replica}", position=replica, disable=not progress,
               unit="prompt")
    # Rows that lost their line end to a kill are dropped on reading; rewrite the part without them.
    kept = read_rows(part)
    part.write_text("".join(json.dumps(row) + "\n" for row in kept.values()))
    started, reported, written, stopped = time.monotonic(), 0, 0, False
    with part.open("a") as sink:
        for first in range(0, len(todo), settings.batch_size):
            if stop is not None and stop.requested:
                stopped = True
                break
            batch = todo[first: first + settings.batch_size]
            torch.manual_seed(settings.seed + batch[0][0])
            budget = answer_bound(settings, max_length, max(len(p) for _, p in batch))
            responses = generate_batch(model, [p for _, p in batch],
                                       GenerationSettings(budget, settings.batch_size, settings.temperature,
                                                          settings.top_p, settings.seed), eos, pad)
            for (index, prompt), response in zip(batch, responses, strict=True):
                sink.write(json.dumps({"id": index, "input_ids": prompt + response,
                                       "loss_mask": [0] * len(prompt) + [1] * len(response)}) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            bar.update(len(batch))
            written += len(batch)
            if progress_every and (written - reported >= progress_every or written == len(todo)):
                reported = written
                rate = written / max(time.monotonic() - started, 1e-9)
                print(json.dumps({"event": "progress", "replica": replica, "rows": written, "of": len(todo),
                                  "rows_per_s": round(rate, 2),
                                  "eta_s": round((len(todo) - written) / rate, 1)}), flush=True)
    bar.close()
    return {"generated": written, "skipped_done": len(done & set(range(replica, len(chats), replicas))),
            "skipped_too_long": too_long, **({"stopped": True} if stopped else {})}


def _replica_entry(replica: int, *args) -> None:
    run_replica(replica, *args, stop=StopSignal().install())


def merge(out: str | Path, replicas: int) -> int:
    """Write every row (from `out` and the parts) to `out` by id, atomically, in memory that grows with the
    row count alone (`dflash_ops.data.row_merge`); remove the parts."""
    out = Path(out)
    parts = [part_path(out, r) for r in range(replicas)]
    total = merge_rows([out, *parts], out)
    for part in parts:
        part.unlink(missing_ok=True)
    return total


def regenerate(target: str, prompts: str, out: str, settings: GenerationSettings, device: str = "cpu",
               replicas: int = 1, dtype: str = "float32", max_length: int | None = None,
               progress: bool = False, enable_thinking: bool = False, progress_every: int = 0,
               stop: StopSignal | None = None, engine: str = "hf", engine_python: str | None = None,
               tensor_parallel: int = 1, turns: str = "last") -> dict:
    """Regenerate the responses of `prompts` with `replicas` target replicas, in the thinking mode
    `enable_thinking` where the chat template takes one; returns a summary. Once `stop` is requested the
    replicas stop (between two batches in process): their rows stay in the parts for the next call, nothing
    is merged and the summary says `stopped`. `engine` vllm runs in processes of `engine_python` (vLLM's
    venv); hf runs in this process, or in processes of `engine_python` where it is given. `turns` last
    answers each chat's end; all, every assistant turn in order (in process only)."""
    started = time.monotonic()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    # Bad prompts, a mode the template cannot take or another mode than the rows there fail here,
    # before any model is loaded.
    problem = local_model_problem(target, "--target")
    if problem:
        raise ValueError(f"--target: {problem}")
    positions = target_text_config(target).get("max_position_embeddings")
    positions = positions if isinstance(positions, int) else None
    if max_length is None:  # the recipe's bound, within the target's positions
        max_length = min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH)
    if positions and max_length > positions:
        raise ValueError(f"--max-length {max_length} is over the target's max_position_embeddings "
                         f"({positions}): "
                         f"its positions beyond were never trained; give --max-length {positions} or less")
    if turns not in ("last", "all"):
        raise ValueError(f"--turns: expected last or all, got {turns!r}")
    if turns == "all" and engine_python:
        raise ValueError(f"--turns all answers each turn after the one before it, in this process: give "
                         f"--engine hf (without --engine-python), or --turns last for the {engine} engine")
    read_chats(prompts)
    mode, takes = thinking_mode(target, enable_thinking)
    record = {"format": FORMAT, "target": str(target), "prompts": str(prompts), "enable_thinking": mode,
              "template_takes_thinking": takes,
              "generation": {**dataclasses.asdict(settings), "max_length": max_length, "dtype": dtype,
                             "engine": engine, "turns": turns}}
    check_resume(Path(out), record)
    if engine == "vllm" and not engine_python:
        raise ValueError("the vllm engine needs the python of vLLM's venv (engine_python)")
    write_json(parts_record_path(out), record)
    args = (replicas, target, prompts, out, device, dtype, settings, max_length, progress, mode,
            progress_every, turns)
    if engine_python:
        from dflash_ops.data.regenerate_engine import run_on_engines

        counts = run_on_engines(engine_python, engine, replicas, target, prompts, out, device, dtype,
                                settings, max_length, mode, progress_every, tensor_parallel, stop)
    elif replicas == 1:
        counts = run_replica(0, *args, stop=stop)
    else:
        import torch.multiprocessing as mp

        devices = [f"cuda:{r}" for r in range(replicas)] if device == "cuda" else ["cpu"] * replicas
        processes = []
        context = mp.get_context("spawn")
        for replica in range(replicas):
            replica_args = (replicas, target, prompts, out, devices[replica], dtype, settings, max_length,
                            progress, mode, progress_every, turns)
            process = context.Process(target=_replica_entry, args=(replica, *replica_args))
            process.start()
            processes.append(process)
        forwarded = False
        while any(process.is_alive() for process in processes):
            if stop is not None and stop.requested and not forwarded:
                for process in processes:  # SIGTERM: each replica stops after its batch at hand
                    process.terminate()
                forwarded = True
            time.sleep(0.2)
        failed = [r for r, p in enumerate(processes) if p.exitcode != 0]
        if failed and not forwarded:
            raise RuntimeError(f"replicas {failed} failed; their finished rows are kept, run again to resume")
        counts = {}
    seconds = round(time.monotonic() - started, 1)
    if counts.get("stopped") or (stop is not None and stop.requested):
        done = len(read_rows(Path(out))) + sum(len(read_rows(part)) for part in parts(Path(out)))
        return {**counts, "stopped": True, "rows": done, "of": sum(1 for chat in read_chats(prompts) if chat),
                "replicas": replicas, "enable_thinking": mode, "seconds": seconds}
    total = merge(out, replicas)
    write_json(manifest_path(out), {**record, "rows": total})
    if not parts(Path(out)):  # parts of another replica count keep their record
        parts_record_path(out).unlink(missing_ok=True)
    return {**counts, "rows": total, "replicas": replicas, "enable_thinking": mode, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    from dflash_ops.data.regenerate_engine import ENGINE_PYTHON_ENV, resolve_engine

    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.data regenerate",
        description="Answer a prompt set with the target (its chat template, its own responses) and write "
                    "the training JSON lines, loss_mask 1 on the responses. Resumable: run it again after "
                    "a stop and it skips the prompts already answered.",
    )
    parser.add_argument("--target", required=True, help="the target model directory (with its tokenizer)")
    parser.add_argument("--prompts", required=True,
                        help='JSON lines, each {"messages": [{"role": "user", "content": "..."}, ...]} or '
                             'the bare list, or ShareGPT/SpecForge {"conversations": [{"from"|"role", '
                             '"value"|"content"}]}; or a local parquet/Arrow file or directory of such rows '
                             "(through pyarrow); a last assistant message is replaced by the target's answer")
    parser.add_argument("--out", required=True,
                        help="the training JSON lines to write (and <out>.manifest.json beside them)")
    parser.add_argument("--enable-thinking", choices=("true", "false"), default="false",
                        help="the chat template's enable_thinking (Qwen3's thinking mode; default false, "
                             "what the public Qwen3 DFlash drafters are trained on): the run's "
                             "data.enable_thinking must match it. A template without the toggle is given "
                             "nothing and the mode recorded is null; true is then an error")
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                        help="vllm: vLLM's offline engine (continuous batching, paged KV cache) in processes "
                             "of its venv's python; hf: transformers' generate on static batches, in this "
                             "process (slow: a fallback). auto (default): vllm where it is installed "
                             f"(--engine-python, this python, ${ENGINE_PYTHON_ENV}), else hf")
    parser.add_argument("--engine-python", metavar="PYTHON",
                        help="the python of the venv vLLM is installed in (the env role's "
                             "dflash_env_engine_venv); with --engine hf, transformers runs in processes "
                             "of it")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="vllm on cuda: GPUs per engine, for a target that needs more than one "
                             "(default 1: one engine per GPU, each on its share of the prompts)")
    parser.add_argument("--turns", choices=("last", "all"), default="last",
                        help="last (default): the target answers each chat's end, the chat's earlier "
                             "assistant messages kept as they are and not scored; all: every assistant turn "
                             "is answered in order (each turn's prompt holds the target's earlier answers) "
                             "and scored, as SpecForge scores multi-turn chats (--engine hf only)")
    parser.add_argument("--config", metavar="RUN.yaml",
                        help="the run's config: its data.max_length is the default --max-length")
    parser.add_argument("--max-length", type=int,
                        help="prompt + answer limit: an answer ends at it, a longer prompt is skipped and "
                             "counted (default: the --config's data.max_length, else "
                             f"{DEFAULT_MAX_LENGTH} or the "
                             "target's max_position_embeddings where that is less)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="answer length limit below the room --max-length leaves (default: none)")
    parser.add_argument("--batch-size", type=int, default=8, help="hf: prompts answered together (default 8)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when sampling (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default) or cuda: one target replica per visible GPU")
    parser.add_argument("--replicas", type=int,
                        help="target replicas (default: 1 on cpu, every visible GPU on cuda)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="target dtype (default bfloat16, what the target is served in: its answers)")
    parser.add_argument("--threads", type=int, help="torch threads per replica on cpu")
    parser.add_argument("--status-file", metavar="PATH",
                        help='the job\'s state, as a run\'s status.json says it: {"state": "running"}, then '
                             '"stopped" with its stop_reason ("finished", or "signal SIGTERM" for a stop), '
                             'or "failed" with its error (a boot starts a job again that did not end by '
                             'itself)')
    parser.add_argument("--progress-every", type=int, default=100, metavar="N",
                        help='a {"event": "progress"} line on stdout (rows written, of, rows/s, ETA) each '
                             "time a replica has written N more rows (default 100; 0: none)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = StopSignal().install()  # SIGTERM/SIGINT: stop between two batches, keep the rows, exit 0

    def state(**fields) -> None:
        if args.status_file:
            write_json(Path(args.status_file), {**fields, "pid": os.getpid(), "out": args.out,
                                          "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    try:
        state(state="running")
        max_length = args.max_length or (load_config(args.config, check_target=False).data.max_length
                                         if args.config else None)
        engine, python, why = resolve_engine(args.engine, args.engine_python)
        tensor_parallel = args.tensor_parallel_size if engine == "vllm" else 1
        if tensor_parallel < 1:
            raise ValueError("--tensor-parallel-size must be >= 1")
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        replicas = args.replicas or (gpus // tensor_parallel if args.device == "cuda" else 1)
        print(json.dumps({"event": "engine", "engine": engine, "python": python, "why": why,
                          "replicas": replicas}), flush=True)
        if args.device == "cuda" and not 1 <= replicas * tensor_parallel <= gpus:
            raise ValueError(f"--device cuda: {replicas} replicas of {tensor_parallel} GPUs for {gpus} "
                             "visible GPUs")
        if replicas < 1:
            raise ValueError("--replicas must be >= 1")
        settings = GenerationSettings(args.max_new_tokens, args.batch_size, args.temperature, args.top_p,
                                      args.seed)
        summary = regenerate(args.target, args.prompts, args.out, settings, args.device, replicas, args.dtype,
                             max_length, progress=sys.stderr.isatty(),
                             enable_thinking=args.enable_thinking == "true",
                             progress_every=max(0, args.progress_every), stop=stop, engine=engine,
                             engine_python=python, tensor_parallel=tensor_parallel, turns=args.turns)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        state(state="failed", error=str(err).splitlines()[0])
        return 2
    finally:
        stop.restore()
    if summary.get("stopped"):
        signal_name = summary.pop("signal", None) or stop.signal_name
        print(json.dumps({"event": "stopped", "out": args.out, "signal": signal_name, **summary}))
        print(f"dflash_ops.data regenerate: stopped by {signal_name}: {summary['rows']} of {summary['of']} "
              f"prompts have their row (kept in {args.out} and its parts); run the same command again to "
              "go on", file=sys.stderr)
        state(state="stopped", stop_reason=f"signal {signal_name}", rows=summary["rows"], of=summary["of"])
        return 0
    print(json.dumps({"event": "regenerated", "out": args.out, **summary}))
    state(state="stopped", stop_reason="finished", rows=summary["rows"])
    return 0
