"""Regeneration on an engine in processes of its own (`dflash_ops.data.engine_worker`): vLLM in its own venv,
one engine per GPU (or per `--tensor-parallel-size` GPUs), each answering its share of the prompts.

This side keeps what `dflash_ops.data.regenerate` keeps for the in-process path: it tokenizes each prompt (the
chat template, the thinking mode), writes it to an engine's stdin as the engine takes it (a pipe: memory
bounded whatever the prompt count), and writes each answer to `<out>.part-<r>` as it arrives, in the order
the engine finishes them. A `progress` line (rows of all, rows/s, output tokens/s, ETA) comes every
`progress_every` rows. A stop (SIGTERM/SIGINT) ends the engines (their process groups) and keeps the rows;
an engine that dies (out of memory, a killed worker) ends the call with its exit and the end of its log,
the rows written kept: the next call resumes. Each engine's log is `<out>.engine-<r>.log`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import dflash_ops
from dflash_ops.data.chat_prompts import (
    PendingPrompts,
    answer_bound,
    load_tokenizer,
    part_path,
    read_chats,
    read_rows,
)

# Where the engine's interpreter is named when neither --engine-python nor this one's own has vLLM.
ENGINE_PYTHON_ENV = "DFLASH_VLLM_PYTHON"
# What the engine's processes get beside the caller's environment: no network use, no usage report.
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
              "TOKENIZERS_PARALLELISM": "false"}
# vLLM's dtype names for the trainer's.
VLLM_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
STOP_GRACE_S = 30.0


class EngineError(RuntimeError):
    """An engine cannot be started, or ended before it answered every request."""


def python_has_vllm(python: str) -> bool:
    """Whether `python` finds the vllm package (a lookup, not an import: seconds saved)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_engine(engine: str, engine_python: str | None) -> tuple[str, str | None, str]:
    """(engine, the interpreter that runs it, why): `auto` is vllm where it is installed (`engine_python`,
    else this interpreter, else $DFLASH_VLLM_PYTHON), else hf. `vllm` where it is not is an error."""
    if engine == "hf":
        if engine_python:
            return "hf", engine_python, "--engine hf --engine-python: in processes of its own"
        return "hf", None, "--engine hf"
    candidates = [engine_python] if engine_python else [sys.executable, os.environ.get(ENGINE_PYTHON_ENV)]
    for python in filter(None, candidates):
        if (python == sys.executable and importlib.util.find_spec("vllm")) or \
                (python != sys.executable and python_has_vllm(python)):
            return "vllm", python, f"vLLM in {python}"
    looked = ", ".join(filter(None, candidates)) or "nowhere"
    if engine == "vllm":
        raise EngineError(f"--engine vllm: no vLLM in {looked}; name its venv's python with --engine-python "
                          f"(or ${ENGINE_PYTHON_ENV}), or regenerate with --engine hf")
    return "hf", None, f"no vLLM in {looked}: transformers' generate (slow; see --engine)"


def engine_groups(device: str, replicas: int, tensor_parallel: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each engine (None on CPU): `replicas` groups of `tensor_parallel`
    consecutive GPUs of those this process sees."""
    if device != "cuda":
        return [None] * replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if replicas * tensor_parallel > len(gpus):
        raise EngineError(f"{replicas} engines of {tensor_parallel} GPUs need {replicas * tensor_parallel}, "
                          f"{len(gpus)} are visible")
    return [",".join(gpus[r * tensor_parallel:(r + 1) * tensor_parallel]) for r in range(replicas)]


@dataclass
class Engine:
    """One engine process, its part file and the prompts it is fed."""
    replica: int
    process: subprocess.Popen
    part: Path
    log: Path
    answered: int = 0
    skipped: list = field(default_factory=list)
    done: bool = False
    buffer: bytes = b""


def worker_command(python: str, engine: str, target: str, dtype: str, max_length: int, settings,
                   tensor_parallel: int, batch_size: int) -> list[str]:
    command = [python, "-m", "dflash_ops.data.engine_worker", "--engine", engine, "--target", str(target),
               "--dtype", VLLM_DTYPES[dtype], "--max-length", str(max_length),
               "--temperature", str(settings.temperature), "--top-p", str(settings.top_p),
               "--seed", str(settings.seed), "--batch-size", str(batch_size)]
    return command + (["--tensor-parallel-size", str(tensor_parallel)] if engine == "vllm" else [])


def start_engine(replica: int, command: list[str], gpus: str | None, part: Path) -> Engine:
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(Path(dflash_ops.__file__).resolve().parent.parent)}
    env.pop("VIRTUAL_ENV", None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    log = part.with_name(part.name.replace(".part-", ".engine-") + ".log")
    with log.open("ab") as sink:  # its own session: a stop ends the engine's children with it
        process = subprocess.Popen(command + (["--device", "cuda"] if gpus is not None else []),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, env=env,
                                   start_new_session=True)
    return Engine(replica, process, part, log)


def feed(engine: Engine, requests) -> None:
    """Write each request to the engine's stdin (blocking while the engine's queue is full), then close it;
    an engine that died stops the feeding (its exit is reported by the reader)."""
    try:
        for request in requests:
            engine.process.stdin.write((json.dumps(request) + "\n").encode())
        engine.process.stdin.close()
    except (BrokenPipeError, ValueError, OSError):
        pass


def end_engines(engines: list[Engine]) -> None:
    """SIGTERM to each engine's process group, SIGKILL to what is left after STOP_GRACE_S."""
    for engine in engines:
        if engine.process.poll() is None:
            os.killpg(engine.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for engine in engines:
        try:
            engine.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(engine.process.pid, signal.SIGKILL)
            engine.process.wait()


def reap(engine: Engine) -> int:
    """The engine's exit status, once what is left of its process group (an engine's own processes, which
    outlive it when it is killed) had SIGTERM: sent while its exited leader is not yet reaped, so that the
    group's id is still the engine's."""
    os.waitid(os.P_PID, engine.process.pid, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(engine.process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # the group ended with it
    return engine.process.wait()


def exit_words(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_engines(engines: list[Engine], feeders: list, total: int, progress_every: int, stop,
                on_row) -> dict:
    """Read every engine's answers into its part until all are done, a stop is requested or one dies.
    `on_row(engine, record)` writes a row; returns the counts."""
    selector = selectors.DefaultSelector()
    for engine in engines:
        os.set_blocking(engine.process.stdout.fileno(), False)
        selector.register(engine.process.stdout, selectors.EVENT_READ, engine)
    started, reported, written, tokens, ready = time.monotonic(), 0, 0, 0, None
    try:
        while selector.get_map():
            if stop is not None and stop.requested:
                end_engines(engines)
                return {"generated": written, "output_tokens": tokens, "stopped": True}
            for key, _ in selector.select(timeout=0.5):
                engine = key.data
                chunk = engine.process.stdout.read()
                if chunk:
                    engine.buffer += chunk
                    *lines, engine.buffer = engine.buffer.split(b"\n")
                    for line in lines:
                        record = json.loads(line)
                        if "response" in record:
                            if not written:  # rates from the first answer: not the engines' start
                                started = time.monotonic()
                            on_row(engine, record)
                            engine.answered += 1
                            written, tokens = written + 1, tokens + len(record["response"])
                        elif "skipped" in record:
                            engine.skipped.append(record)
                        elif record.get("event") == "done":
                            engine.done = True
                        elif record.get("event") == "ready":
                            ready = time.monotonic()  # the last engine's: generation starts there
                    continue
                selector.unregister(engine.process.stdout)  # end of output: the engine ended
                code = reap(engine)
                if code in (-signal.SIGTERM, -signal.SIGINT):  # stopped as a job is (a shutdown): not a fault
                    end_engines(engines)
                    return {"generated": written, "output_tokens": tokens, "stopped": True,
                            "signal": signal.Signals(-code).name}
                if not engine.done or code != 0:
                    end_engines(engines)
                    raise EngineError(
                        f"the engine of replica {engine.replica} ended ({exit_words(code)}) after answering "
                        f"{engine.answered} of the prompts it was given; every row written is kept: run "
                        f"the same command again to resume. The end of its log ({engine.log}):\n"
                        + log_tail(engine.log))
            if progress_every and written > reported and (written - reported >= progress_every
                                                          or written == total):
                reported = written
                elapsed = max(time.monotonic() - started, 1e-9)
                rate = written / elapsed
                print(json.dumps({"event": "progress", "rows": written, "of": total,
                                  "rows_per_s": round(rate, 2), "tokens_per_s": round(tokens / elapsed, 1),
                                  "eta_s": round((total - written) / rate, 1) if rate else None}), flush=True)
    finally:
        selector.close()
        for feeder in feeders:
            feeder.join(timeout=STOP_GRACE_S)
    generating = time.monotonic() - (ready or started)
    return {"generated": written, "output_tokens": tokens, "generation_seconds": round(generating, 2),
            "tokens_per_s": round(tokens / max(generating, 1e-9), 1),
            "skipped_by_engine": sum(len(engine.skipped) for engine in engines)}


def start_feeder(engine: Engine, requests) -> threading.Thread:
    thread = threading.Thread(target=feed, args=(engine, requests), daemon=True)
    thread.start()
    return thread


def run_on_engines(python: str, engine: str, replicas: int, target_path: str, prompts_path: str, out: str,
                   device: str, dtype: str, settings, max_length: int, mode: bool | None,
                   progress_every: int, tensor_parallel: int = 1, stop=None) -> dict:
    """Answer the prompts without a row on `replicas` engine processes (`dflash_ops.data.regenerate_engine`),
    engine r on the prompts r::replicas, its rows to part r as they finish. Returns counts."""

    out_path = Path(out)
    chats = read_chats(prompts_path)
    groups = engine_groups(device, replicas, tensor_parallel)
    command = worker_command(python, engine, target_path, dtype, max_length, settings, tensor_parallel,
                                     settings.batch_size)
    processes, feeders, pendings, sinks, skipped_done, total = [], [], [], {}, 0, 0
    asked: dict[int, list[int]] = {}  # the prompts in flight, by id (bounded: the engines' queues)

    def request(index: int, prompt: list[int]) -> dict:
        asked[index] = prompt
        return {"id": index, "prompt": prompt, "seed": settings.seed + index,
                "max_tokens": answer_bound(settings, max_length, len(prompt))}

    for replica in range(replicas):
        part = part_path(out_path, replica)
        done = set(read_rows(out_path)) | set(read_rows(part))
        mine = range(replica, len(chats), replicas)
        skipped_done += len(done & set(mine))
        todo = [index for index in mine if index not in done and chats[index]]
        total += len(todo)
        kept = read_rows(part)  # rows that lost their line end to a kill are dropped: rewrite without them
        part.write_text("".join(json.dumps(row) + "\n" for row in kept.values()))
        pending = PendingPrompts(load_tokenizer(target_path), chats, mode, max_length)
        process = start_engine(replica, command, groups[replica], part)
        sinks[replica] = part.open("a")
        processes.append(process)
        pendings.append(pending)
        feeders.append(start_feeder(process, (request(*item) for item in pending.prompts(todo))))

    def on_row(process, record) -> None:
        sink = sinks[process.replica]
        prompt = asked.pop(record["id"])
        sink.write(json.dumps({"id": record["id"], "input_ids": prompt + record["response"],
                               "loss_mask": [0] * len(prompt) + [1] * len(record["response"])}) + "\n")
        sink.flush()

    try:
        counts = run_engines(processes, feeders, total, progress_every, stop, on_row)
    finally:
        for sink in sinks.values():
            os.fsync(sink.fileno())
            sink.close()
    if not counts.get("stopped"):  # each engine answered all it was given: its log says nothing more
        for process in processes:
            process.log.unlink(missing_ok=True)
    return {**counts, "skipped_done": skipped_done, "skipped_too_long": sum(p.too_long for p in pendings),
            "engine": engine}
