"""`python -m dflash_ops.capture --config <yaml> [--out DIR]`: the target's features of the config's
data set, captured once into a feature cache (`dflash_ops.data.feature_cache`) that drafter runs read
instead of running the target (`data.features_path`).

The target runs on the batches a run of this config gives it in its first epoch (`BatchOrder`'s
epoch-0 order for `data.batch_size` and `run.seed`, the last batch holding the rest), so that the
first epoch from the cache trains on the very features the online target computes. It captures
`model.target_layer_ids` (or their default) in `model.dtype`, with `model.target_rows_per_pass`.
One target replica per visible GPU with `pipeline.device: cuda` (as `dflash_ops.data regenerate`), or
`--replicas` on CPU; replica r writes shards r, r+R, ... Each shard is streamed to a hidden temp
file as the target computes it (its sha256 on the way), fsynced, renamed, then recorded: a stopped
or killed capture started again writes only the shards without a record. SIGTERM: each replica
finishes the shard at hand, and the capture exits 0 (`{"event": "stopped", ...}`).

Before the target is loaded, the bytes still to write (exact: the plan knows every shard's tokens)
are compared with the free space of the output's file system; a capture that does not fit is
refused with both figures. Progress: a bar on a terminal, one JSON line per shard (tokens/s, ETA),
and `{"event": "captured", ...}` when the manifest is written. Exit codes: 0 done or stopped, 1
crashed, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from dflash_ops.core.config import TrainConfig, target_shape
from dflash_ops.core.files import fsync_path
from dflash_ops.core.runtime import SHARED_DIR_MODE, EventLog, StopSignal, ensure_dir
from dflash_ops.data.examples import BatchOrder, Example, training_examples
from dflash_ops.data.feature_cache import (
    FORMAT,
    MANIFEST,
    PLAN,
    file_sha256,
    free_bytes,
    gib,
    plan_shards,
    record_name,
    resolved_layer_ids,
    shard_header,
    target_identity,
    write_json,
)
from dflash_ops.data.subset import SUBSET_FILE
from dflash_ops.data.target import load_target, target_document_states

# Test knobs: the free bytes the disk-space check sees instead of the file system's; seconds a replica
# pauses after each shard (cut short by a stop), so that a test's stop lands between two shards.
FREE_BYTES_ENV = "DFLASH_TEST_FREE_BYTES"
SHARD_DELAY_ENV = "DFLASH_TEST_SHARD_DELAY_S"
DEFAULT_SHARD_MB = 512


class CaptureError(ValueError):
    """The capture cannot start: its output directory, its free space, another capture's plan."""


def capture_batches(n_examples: int, batch_size: int, seed: int) -> list[list[int]]:
    """The first epoch of a run's batch order, in batches of `batch_size` (the last one the rest)."""
    single = BatchOrder(n_examples, 1, seed)
    order = [single.next_batch()[0] for _ in range(n_examples)]
    return [order[i: i + batch_size] for i in range(0, n_examples, batch_size)]


def hidden_size(target_path: str) -> int:
    raw = json.loads((Path(target_path) / "config.json").read_text())
    return int((raw.get("text_config") or raw)["hidden_size"])


def make_plan(cfg: TrainConfig, examples: list[Example], shard_bytes: int) -> tuple[dict, list[list[int]]]:
    """The capture's plan (see `dflash_ops.data.feature_cache`) and its batches of example indices."""
    batches = capture_batches(len(examples), cfg.data.batch_size, cfg.run.seed)
    layer_ids = resolved_layer_ids(cfg)
    width = len(layer_ids) * hidden_size(cfg.model.target_path)
    sizes = [(len(batch), sum(examples[i].input_ids.numel() for i in batch)) for batch in batches]
    plan = {
        "format": FORMAT,
        "target": target_identity(cfg.model.target_path),
        "layer_ids": layer_ids, "dtype": cfg.model.dtype, "width": width,
        "dataset": {"path": str(cfg.data.path), "sha256": file_sha256(cfg.data.path),
                    "examples": len(examples), "max_length": cfg.data.max_length,
                    "min_loss_tokens": cfg.data.min_loss_tokens,
                    "tokens": sum(n for _, n in sizes)},
        "order": {"batch_size": cfg.data.batch_size, "seed": cfg.run.seed},
        "shards": plan_shards(sizes, width, cfg.model.dtype, shard_bytes),
    }
    return plan, batches


def finished_shards(out: Path, plan: dict) -> dict[str, dict]:
    """name -> record (sha256, bytes) of each shard of `plan` that is written, by its record or by
    the manifest, at its planned size."""
    records: dict[str, dict] = {}
    if (out / MANIFEST).is_file():
        records.update({s["name"]: s for s in json.loads((out / MANIFEST).read_text())["shards"]})
    for shard in plan["shards"]:
        path = out / record_name(shard["name"])
        if path.is_file():
            records[shard["name"]] = json.loads(path.read_text())
    return {s["name"]: records[s["name"]] for s in plan["shards"] if s["name"] in records
            and (out / s["name"]).is_file() and (out / s["name"]).stat().st_size == s["bytes"]}


def _comparable(plan: dict) -> dict:
    """A plan less the paths it was made from (a cache may be captured again from a moved copy)."""
    return {**plan, **{part: {k: v for k, v in plan.get(part, {}).items() if k != "path"}
                       for part in ("target", "dataset")}}


def prepare(cfg: TrainConfig, out: Path, plan: dict, free: int | None) -> list[str]:
    """Check `out` and its space for `plan`, write the plan; the names of the shards to write."""
    if out.exists() and not out.is_dir():
        raise CaptureError(f"{out} is not a directory")
    if out.is_dir() and (out / PLAN).is_file():
        old, new = _comparable(json.loads((out / PLAN).read_text())), _comparable(plan)
        differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if differ:
            raise CaptureError(f"{out} holds a capture with another plan (it differs in "
                               f"{', '.join(differ)}): finish it with its own config, or capture elsewhere")
    elif out.is_dir() and any(p.name != SUBSET_FILE for p in out.iterdir()):
        raise CaptureError(f"{out} is not empty and holds no capture: capture into an empty or new directory")
    for stale in out.glob(".shard-*.tmp") if out.is_dir() else []:
        stale.unlink()  # a shard cut short by a kill
    done = finished_shards(out, plan)
    todo = [s for s in plan["shards"] if s["name"] not in done]
    needed = sum(s["bytes"] for s in todo)
    available = free if free is not None else free_bytes(out)
    if needed > available:
        raise CaptureError(f"the capture needs an estimated {gib(needed)} ({needed} bytes: {len(todo)} "
                           f"shard(s), {plan['width']} features of {cfg.model.dtype} a token) in {out}, "
                           f"whose file system has {gib(available)} free ({available} bytes): free some "
                           "space or capture elsewhere (--out)")
    ensure_dir(out, SHARED_DIR_MODE)  # the run's user reads the cache
    if not (out / PLAN).is_file():
        write_json(out / PLAN, plan)
    if todo and (out / MANIFEST).is_file():
        (out / MANIFEST).unlink()  # a shard went missing: the cache is unfinished until it is rewritten
    return [s["name"] for s in todo]


class BackgroundWriter:
    """Writes and hashes the parts of a file on a thread (hashlib and file writes release the GIL),
    at most two parts behind the caller, so that the target computes while the last batch is written."""

    def __init__(self, f):
        self.f, self.digest, self.error = f, hashlib.sha256(), None
        self.parts: queue.Queue = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._write, name="shard-writer", daemon=True)
        self.thread.start()

    def _write(self) -> None:
        while (part := self.parts.get()) is not None:
            if self.error is None:
                try:
                    data = part if isinstance(part, bytes) else _bytes(part)
                    self.f.write(data)
                    self.digest.update(data)
                except BaseException as exc:  # raised by close(); the rest is dropped
                    self.error = exc

    def put(self, part: bytes | torch.Tensor) -> None:
        if self.error is not None:
            raise self.error
        self.parts.put(part)

    def close(self) -> str:
        """Wait for every part to be written; the file's sha256."""
        self.parts.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest()


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def write_shard(out: Path, shard: dict, plan: dict, batches: list[list[int]], examples: list[Example],
                features_of) -> dict:
    """Stream one shard to a hidden temp file (features batch by batch from `features_of(batch)`),
    fsync, rename, then write its record; return the record."""
    first, end = shard["batches"]
    docs = [i for batch in batches[first:end] for i in batch]
    lengths = [examples[i].input_ids.numel() for i in docs]
    prefix, ranges = shard_header(shard["tokens"], shard["documents"], plan["width"], plan["dtype"])
    cu_seqlens = torch.zeros(len(docs) + 1, dtype=torch.int64)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    head = [cu_seqlens, torch.tensor(docs, dtype=torch.int64),
            torch.cat([examples[i].input_ids for i in docs]).to(torch.int32),
            torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])]
    loss_mask = torch.cat([examples[i].loss_mask for i in docs]).to(torch.uint8)
    tmp, final = out / f".{shard['name']}.tmp", out / shard["name"]
    with tmp.open("wb") as f:
        sink = BackgroundWriter(f)
        try:
            for part in (prefix, *head):
                sink.put(part)
            for batch in batches[first:end]:
                sink.put(features_of(batch).cpu())  # the next batch runs while this one is written
            sink.put(loss_mask)
        finally:
            digest = sink.close()
        f.flush()
        os.fsync(f.fileno())
    if tmp.stat().st_size != max(e for _, e in ranges.values()):
        raise RuntimeError(f"{tmp}: wrote {tmp.stat().st_size} bytes, the plan says {shard['bytes']}")
    os.replace(tmp, final)
    fsync_path(out)  # the shard is in place before its record says so
    record = {"name": shard["name"], "sha256": digest, "bytes": shard["bytes"]}
    write_json(out / record_name(shard["name"]), record)
    return record


def run_replica(replica: int, replicas: int, cfg: TrainConfig, out: Path, plan: dict,
                batches: list[list[int]], todo: list[str], device: str, report, stop: StopSignal) -> None:
    """Write this replica's shards of `todo` (every `replicas`-th), reporting each; stop between shards."""
    torch.set_num_threads(cfg.pipeline.threads_per_worker)
    mine = [s for s in plan["shards"] if s["name"] in todo][replica::replicas]
    if not mine:
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    target = load_target(cfg.model.target_path, cfg.model.dtype, device)
    examples = training_examples(cfg.data)

    def features_of(batch: list[int]) -> torch.Tensor:  # the documents packed: no padding computed
        documents = [examples[i].input_ids for i in batch]
        packed = target_document_states(target, torch.cat(documents).to(device),
                                        [d.numel() for d in documents], plan["layer_ids"],
                                        cfg.model.target_rows_per_pass)
        return packed.features

    for shard in mine:
        if stop.requested:
            return
        started = time.perf_counter()
        record = write_shard(out, shard, plan, batches, examples, features_of)
        report({"replica": replica, "shard": shard["name"], "tokens": shard["tokens"],
                "seconds": round(time.perf_counter() - started, 3), "sha256": record["sha256"]})
        stop.sleep(float(os.environ.get(SHARD_DELAY_ENV, "0")))


def _replica_process(replica: int, replicas: int, cfg, out, plan, batches, todo, device, reports) -> None:
    stop = StopSignal().install()
    try:
        run_replica(replica, replicas, cfg, out, plan, batches, todo, device, reports.put, stop)
    except BaseException as exc:
        reports.put({"replica": replica, "error": f"{type(exc).__name__}: {exc}"})
        raise


class Progress:
    """The capture's JSON lines and, on a terminal, its bar (tokens, rate, ETA)."""

    def __init__(self, log: EventLog, total_tokens: int):
        from tqdm import tqdm

        self.log, self.total, self.done = log, total_tokens, 0
        self.started = time.perf_counter()
        self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="capture",
                        disable=not sys.stderr.isatty())

    def shard(self, report: dict, shards_done: int, shards_total: int) -> None:
        self.done += report["tokens"]
        self.bar.update(report["tokens"])
        rate = self.done / max(time.perf_counter() - self.started, 1e-9)
        self.log.emit("shard", **{k: report[k] for k in ("replica", "shard", "tokens", "seconds")},
                      shards_done=shards_done, shards_total=shards_total, tokens_per_s=round(rate, 1),
                      eta_s=round((self.total - self.done) / max(rate, 1e-9), 1))


def capture(cfg: TrainConfig, out: str | Path, replicas: int = 1, shard_bytes: int = DEFAULT_SHARD_MB << 20,
            free: int | None = None, log: EventLog | None = None, stop: StopSignal | None = None,
            subset: dict | None = None) -> dict:
    """Capture the features of `cfg`'s data set into `out`; the summary of the last event line. With
    `subset` (`dflash_ops.data.subset.write_subset`'s record of the rows written to `out`/data.jsonl), that
    file is the data set."""
    started = time.perf_counter()
    out, log, stop = Path(out), log or EventLog(0), stop or StopSignal()
    device = cfg.pipeline.device
    if subset is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(out / SUBSET_FILE)))
    examples = training_examples(cfg.data, target_shape(cfg.model.target_path)[1])
    plan, batches = make_plan(cfg, examples, shard_bytes)
    if subset is not None:
        plan["dataset"]["subset"] = subset
    todo = prepare(cfg, out, plan, free)
    shards_total = len(plan["shards"])
    todo_tokens = sum(s["tokens"] for s in plan["shards"] if s["name"] in todo)
    todo_bytes = sum(s["bytes"] for s in plan["shards"] if s["name"] in todo)
    total_bytes = sum(s["bytes"] for s in plan["shards"])
    log.emit("capture_start", out=str(out), shards=shards_total, shards_to_write=len(todo),
             tokens=todo_tokens, bytes=todo_bytes, replicas=replicas, layer_ids=plan["layer_ids"],
             width=plan["width"], dtype=plan["dtype"], total_bytes=total_bytes,
             bytes_per_token=round(total_bytes / max(1, plan["dataset"]["tokens"]), 1))
    progress = Progress(log, todo_tokens)
    written = 0

    def on_report(report: dict) -> None:
        nonlocal written
        if "error" in report:
            raise RuntimeError(f"replica {report['replica']} failed: {report['error']}")
        written += 1
        progress.shard(report, shards_total - len(todo) + written, shards_total)

    if replicas == 1:
        device = "cuda:0" if device == "cuda" else "cpu"
        run_replica(0, 1, cfg, out, plan, batches, todo, device, on_report, stop)
    else:
        run_spawned(replicas, cfg, out, plan, batches, todo, device, on_report, stop)
    progress.bar.close()
    done = finished_shards(out, plan)
    summary = {"out": str(out), "shards": shards_total, "shards_written": written,
               "tokens": plan["dataset"]["tokens"], "seconds": round(time.perf_counter() - started, 3),
               "tokens_per_s": round(progress.done / max(time.perf_counter() - progress.started, 1e-9), 1)}
    if len(done) < shards_total:
        log.emit("stopped", **summary, shards_done=len(done), reason=f"signal {stop.signal_name}")
        return {"event": "stopped", **summary}
    write_json(out / MANIFEST, {**plan, "shards": [{**s, "sha256": done[s["name"]]["sha256"]}
                                                   for s in plan["shards"]]})
    for shard in plan["shards"]:
        (out / record_name(shard["name"])).unlink(missing_ok=True)
    summary["bytes"] = sum(s["bytes"] for s in plan["shards"])
    if subset is not None:  # what a run that reads it must name
        summary["data_path"] = cfg.data.path
    log.emit("captured", **summary)
    return {"event": "captured", **summary}


def run_spawned(replicas: int, cfg, out, plan, batches, todo, device, on_report, stop: StopSignal) -> None:
    """One process per replica (spawned: CUDA and torch threads start clean), reporting through a
    queue; a stop here is passed on to each once, a replica's failure stops the others."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    reports = context.Queue()
    devices = [f"cuda:{r}" for r in range(replicas)] if device == "cuda" else ["cpu"] * replicas
    processes = [context.Process(target=_replica_process,
                                 args=(r, replicas, cfg, out, plan, batches, todo, devices[r], reports))
                 for r in range(replicas)]
    for process in processes:
        process.start()
    forwarded = False
    try:
        while any(p.is_alive() for p in processes) or not reports.empty():
            if stop.requested and not forwarded:
                forwarded = True
                for process in processes:
                    if process.is_alive():
                        process.terminate()  # SIGTERM: the replica finishes its shard
            try:
                on_report(reports.get(timeout=0.2))
            except queue.Empty:
                pass
    except BaseException:
        for process in processes:  # one failed: the others stop at their next shard boundary
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            process.join()
    # A replica that the stop reached before it could install its handler ended by the signal: stopped.
    stopped_early = -signal.SIGTERM if stop.requested else None
    failed = [r for r, p in enumerate(processes) if p.exitcode not in (0, stopped_early)]
    if failed:
        codes = [processes[r].exitcode for r in failed]
        raise RuntimeError(f"replicas {failed} failed (exit codes {codes}); their finished shards are kept, "
                           "run the capture again to resume")
