"""Pipeline workers: target ranks feed packed hidden states to drafter ranks that train with DDP.

torchrun, started by the launcher (`dflash_ops.run.launcher`), runs one `python -m dflash_ops.run.pipeline
--config <yaml>` per worker with RANK, LOCAL_RANK and WORLD_SIZE set; the role follows from the global rank
(`dflash_ops.run.ranks`: drafters first, rank 0 is drafter 0) and the device from LOCAL_RANK
(`cuda:LOCAL_RANK`). Ranks talk through `torch.distributed` (gloo on CPU, nccl on GPUs); the batches
travel as `dflash_ops.run.transport` sends them. When torchrun restarts the group after a worker died,
every worker resumes from the latest checkpoint.

Batch schedule. Batches are numbered i = 0, 1, 2... in the data order of a single-process run
(`BatchOrder`, resumed from the checkpoint's data position: its count of the batches taken, so that
a resume with other numbers of drafters or targets starts at the next untrained batch, `batch_span`).
Target rank j computes the batches with i % T == j; batch i goes to drafter rank i % D, which trains
on one batch per optimizer step (D drafters: a step uses the next D batches, one per drafter,
gradients averaged by DDP; without a resume at another D, step s uses batches s*D .. s*D + D - 1).
With one drafter the losses are those of the single-process trainer, bit for bit: same batches,
same target features, same initialisation and anchor RNG. With D > 1 each drafter's loss is the
weighted mean over its own batch and DDP averages the D gradients (a mean of per-rank means, not
one weighted mean over all D batches).

A drafter rank is the single process's drafter side (`DrafterRun`), composed with this module's
`DrafterGroup` (its peers) and `FedBatches` (its batches, from the target ranks).

Stopping. SIGTERM reaches every worker (from the launcher, or from torchrun when it stops the
group to restart it). A target finishes the batch at hand, sends an end marker to each drafter
that still expects batches from it, and exits 0. Drafters agree (`FedBatches`: an all-reduce
among them) to stop before the next step when any of them was signalled or lost its feed,
drafter 0 writes the checkpoint, and all drain what is still in flight and exit 0. The timeouts
on the way: docs/PIPELINE.md, "Stopping: who waits for what".

Failures. A worker that raises writes torchrun's error file (torch.distributed.elastic's error
handler, as `record` writes it, to `TORCHELASTIC_ERROR_FILE`, whose path its `worker_start` line
gives) before it exits non-zero; the launcher reads it to name the cause of a failed start.
"""

from __future__ import annotations

import argparse
import os
import signal as signal_module
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler
from torch.distributed.rendezvous import rendezvous

from dflash_ops.core.cli import add_config_arguments, parse_config_command
from dflash_ops.core.config import ConfigError, PipelineConfig, TrainConfig, load_config, with_examples
from dflash_ops.core.loss_section import capture_layer_ids
from dflash_ops.core.runtime import EventLog, StopSignal
from dflash_ops.core.stopping import (
    DRAIN_AFTER_ERROR_S,
    DRAIN_AFTER_STOP_S,
    PROCESS_GROUP_TIMEOUT,
    STARTUP_TIMEOUT,
    die_with_parent,
)
from dflash_ops.data.examples import BatchOrder, DataError, training_examples
from dflash_ops.data.target import load_target, load_target_head, step_features
from dflash_ops.run.cache_feed import cache_feed
from dflash_ops.run.ranks import BatchSchedule, first_rank, member_leader, rank_table
from dflash_ops.run.transport import FEED_DONE, BatchFeed, recv_batch, send_batch, send_end_markers
from dflash_ops.training.checkpoint import list_checkpoints
from dflash_ops.training.drafter_run import DrafterRun, heldout_examples, latest_to_resume
from dflash_ops.training.heldout import NO_HELDOUT_DOCUMENTS, heldout_documents
from dflash_ops.training.trainer import StepResult, reduce_step, resolve_layer_ids

# A test knob: "<worker name>:<n>" makes that worker raise at its n-th batch (target) or step (drafter).
FAIL_ENV = "DFLASH_TEST_FAIL_AT"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun's: where this worker's error report goes


@dataclass(frozen=True)
class WorkerContext:
    """Who this worker is: its ranks from torchrun's environment, its role from the layout."""

    name: str
    role: str
    role_rank: int
    rank: int  # the run's global rank (`rank_table`): the member's first rank + LOCAL_RANK
    local_rank: int
    world_size: int
    schedule: BatchSchedule
    member_leader: bool  # the first drafter of its member: logs steps, writes the member's checkpoints
    members: int
    torchrun_rank: int  # RANK as torchrun assigned it (members may join its rendezvous in any order)
    restart: int  # torchrun's restart count: 0 for the first start
    gpus: tuple[int, ...]  # the layout's GPU of this worker; () on CPU

    @classmethod
    def from_env(cls, pipeline: PipelineConfig) -> WorkerContext:
        env = os.environ
        try:
            rank, local_rank, world_size = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        except KeyError as missing:
            raise SystemExit(f"dflash_ops.run.pipeline: {missing} is not set; workers are started by "
                             "torchrun through the launcher (python -m dflash_ops.train with a pipeline "
                             "layout)") from None
        table = rank_table(pipeline)
        if world_size != len(table):
            raise ConfigError("pipeline", f"the run's layout has {len(table)} workers, torchrun started "
                              f"{world_size}")
        own = first_rank(pipeline) + local_rank
        gpus = (pipeline.drafter_gpus + pipeline.target_gpus)[local_rank:local_rank + 1]
        return cls(table[own].name, table[own].role, table[own].role_rank, own, local_rank, world_size,
                   BatchSchedule.of(table), member_leader(table, own), len(pipeline.member_counts), rank,
                   int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), tuple(gpus))


def maybe_inject_failure(ctx: WorkerContext, count: int) -> None:
    spec = os.environ.get(FAIL_ENV, "")
    if spec and spec == f"{ctx.name}:{count}":
        raise RuntimeError(f"injected failure in {ctx.name} at {count} ({FAIL_ENV}={spec})")


class WorkerLog(EventLog):
    """JSON lines to stdout (the launcher's pipe), each tagged with the worker's name; only
    drafter 0 reports steps and checkpoints."""

    def __init__(self, total_steps: int, worker: str, leader: bool = False):
        super().__init__(total_steps)  # stderr is the launcher's pipe: no bar here, the launcher draws it
        self.worker, self.leader = worker, leader

    def emit(self, event: str, **fields) -> None:
        if self.leader or event not in ("step", "checkpoint", "resume", "heldout"):
            super().emit(event, worker=self.worker, **fields)


# --- drafter ranks -------------------------------------------------------------------------------
class DrafterGroup:
    """A pipeline's drafter ranks as one of them sees them (`DrafterRun`'s `drafters`): the
    drafters' process group (None with one drafter), through which DDP averages the gradients, the
    stop is agreed, random states are gathered for a checkpoint and the step's figures averaged."""

    def __init__(self, ctx: WorkerContext, group, device: torch.device):
        self.ctx, self.process_group, self.device = ctx, group, device
        self.rank = ctx.role_rank
        # One writer of checkpoints, metrics.jsonl and event files per member (each container has its own).
        self.writes_files = ctx.member_leader

    def gather(self, obj) -> list:
        """`obj` of every drafter, in role rank order (a collective: every drafter must call it)."""
        if self.process_group is None:
            return [obj]
        gathered: list = [None] * self.ctx.schedule.num_drafters
        dist.all_gather_object(gathered, obj, group=self.process_group)
        return gathered

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any drafter (a collective)."""
        value = torch.tensor([int(flag)], device=self.device)
        if self.process_group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(value.item())

    def mean(self, result: StepResult) -> StepResult:
        """The step over all drafters (a collective): the global objective's loss, the accuracy over
        every drafter's scored positions, tokens and blocks summed
        (`dflash_ops.training.trainer.reduce_step`)."""
        return reduce_step(result, self.process_group, self.device)

    def checkpoint_to_resume(self, output_dir: Path, resume: bool) -> Path | None:
        """Across members: the latest step every member has a checkpoint of (a member whose last
        save a kill interrupted resumes with the others from the one before)."""
        own = latest_to_resume(output_dir, resume)
        if self.ctx.members == 1:
            return own
        found = {int(p.name.rpartition("-")[2]): p for p in list_checkpoints(output_dir)}
        everyone = self.gather(sorted(found) if resume else [])
        common = set.intersection(*(set(steps) for steps in everyone))
        if not common and any(everyone):
            raise RuntimeError(f"the members have no checkpoint step in common (each drafter's steps, in "
                               f"role rank order: {everyone}); move the checkpoints aside to start over")
        return found[max(common)] if common else None


class FedBatches:
    """A drafter's batch source (`DrafterRun.run`): the step's batch from the target ranks, taken
    only if every drafter has one and none was signalled. The drafters vote before each step, so
    that none enters a DDP step the others skip; waiting for the batch comes first, since a batch
    that does not come (a target ended early) means stop."""

    def __init__(self, feed: BatchFeed, run: DrafterRun, drafters: DrafterGroup, ctx: WorkerContext):
        self.feed, self.run, self.drafters, self.ctx = feed, run, drafters, ctx
        self.stop_reason = ""

    def next_batch(self, stop: StopSignal) -> dict | None:
        item = self.feed.next(stop)
        batch = item if isinstance(item, dict) else None
        if self.drafters.any(batch is None or stop.requested):
            self.stop_reason = (f"signal {stop.signal_name}" if stop.requested
                                else "a target ended the feed early" if item == FEED_DONE
                                else "another drafter stopped")
            return None
        maybe_inject_failure(self.ctx, self.run.trainer.step + 1)
        for _ in range(self.ctx.schedule.num_drafters):  # the data position the checkpoint records
            self.run.order.next_batch()
        return batch


HELDOUT_INDEX = -1  # the batch index of the held-out features target rank 0 sends drafter 0


def send_heldout(cfg: TrainConfig, target, layer_ids: list[int], dst: int, device: torch.device,
                 group, log: EventLog) -> None:
    """Target rank 0's held-out features for drafter 0, computed and sent `data.batch_size` rows at a time
    (in passes of `model.target_rows_per_pass`, as a training batch): the rank never holds more than a
    training batch's features or capture working set, whatever `data.eval_examples` (docs/SCALE.md)."""
    held_out = heldout_examples(cfg, target.config.vocab_size)
    size = cfg.data.batch_size
    chunks = [held_out[i:i + size] for i in range(0, len(held_out), size)]
    dist.send(torch.tensor([len(chunks)], dtype=torch.int64, device=device), dst, group=group)
    for chunk in chunks:
        send_batch(dst, HELDOUT_INDEX, group=group,
                   **step_features(target, chunk, layer_ids, cfg.model.target_rows_per_pass, device))
    log.emit("heldout_sent", examples=len(held_out), batches=len(chunks), rows_per_batch=size)


def receive_heldout(src: int, device: torch.device, group) -> list:
    """Drafter 0's held-out documents, as `send_heldout` sends them."""
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src, group=group)
    documents = []
    for _ in range(int(count.item())):
        _, features = recv_batch(src, device, group=group)
        documents += heldout_documents(**features, require=False)
    if not documents:
        raise ValueError(NO_HELDOUT_DOCUMENTS)
    return documents


def run_drafter(cfg: TrainConfig, ctx: WorkerContext, stop: StopSignal, device: torch.device,
                startup) -> str:
    group = drafter_group(ctx)
    schedule = ctx.schedule
    drafters = DrafterGroup(ctx, group if schedule.num_drafters > 1 else None, device)
    log = WorkerLog(cfg.total_steps, ctx.name, ctx.member_leader)
    # A drafter holds only the target's head (embedding, lm_head, config), read from its weights.
    run = DrafterRun(cfg, log, load_target_head(cfg.model.target_path, cfg.model.dtype, device), drafters)
    run.resume()
    cfg = run.cfg  # its steps checked against the examples it loaded (and the checkpoint it resumed)
    first_step = run.trainer.step
    first, end = batch_span(cfg, run.order, first_step, schedule.num_drafters)
    position = torch.tensor([first_step, run.order.epoch, run.order.cursor, first, end], dtype=torch.int64,
                            device=device)
    dist.broadcast(position, src=schedule.drafter_ranks[0], group=startup)
    if ctx.role_rank == 0 and cfg.data.eval_path is not None:
        # Drafter 0 evaluates held-out data, whose target features target rank 0 computes on its own
        # device and sends like batches, once: no drafter ever loads the target.
        run.build_heldout(documents=receive_heldout(schedule.target_ranks[0], device, startup))
    n = schedule.num_drafters
    feed = (cache_feed(cfg, run.order, first, end, ctx.role_rank, n) if cfg.data.features_path
            else BatchFeed(schedule, ctx.role_rank, first, end, cfg.pipeline.queue_depth, device))
    try:
        reason = run.run(FedBatches(feed, run, drafters, ctx), stop)
    except BaseException:
        feed.drain(DRAIN_AFTER_ERROR_S)
        raise
    # Checkpointed: say so first (the launcher then stops the targets), then let the targets finish.
    run.log.emit("stop", step=run.trainer.step, reason=reason)
    feed.drain(DRAIN_AFTER_STOP_S)
    if feed.error is not None:
        raise RuntimeError(f"receiving batches failed: {feed.error}") from feed.error
    return reason


def drafter_group(ctx: WorkerContext):
    """The drafters' own process group (DDP and the stop vote); every rank must create it."""
    return dist.new_group(ranks=list(ctx.schedule.drafter_ranks))


def batch_span(cfg: TrainConfig, order: BatchOrder, first_step: int, drafters: int) -> tuple[int, int]:
    """The batches [first, end) this start of the pipeline trains, by index in the run's seeded data
    order: from the next untrained one, the checkpoint's count of the batches taken (`BatchOrder.batches`),
    whatever the number of drafters (or targets) that took them, for as many as its steps take (each
    step one batch per drafter and accumulated micro-batch; `DrafterRun.resume` numbers a checkpoint's
    from before that count as it always was, first_step x drafters)."""
    per_step = drafters * cfg.optim.accumulate
    first = order.batches
    return first, first + (run_end_step(cfg, first_step) - first_step) * per_step


def run_end_step(cfg: TrainConfig, first_step: int) -> int:
    """The optimizer step this process stops after: the end of training or of the per-run budget."""
    end = cfg.total_steps
    if cfg.run.max_steps_per_run is not None:
        end = min(end, first_step + cfg.run.max_steps_per_run)
    return max(end, first_step)


# --- target ranks --------------------------------------------------------------------------------
def run_target(cfg: TrainConfig, ctx: WorkerContext, stop: StopSignal, device: torch.device,
               startup) -> str:
    log = WorkerLog(cfg.total_steps, ctx.name)
    schedule = ctx.schedule
    drafter_group(ctx)
    target = load_target(cfg.model.target_path, cfg.model.dtype, device)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    # What each training batch carries: those layers, and the last one when loss.kind needs the target's
    # distribution (its last hidden state; the held-out features stay the drafter's layers).
    capture_ids = capture_layer_ids(layer_ids, target.config.num_hidden_layers, cfg.loss.mix)
    examples = training_examples(cfg.data, target.config.vocab_size)
    cfg = with_examples(cfg, len(examples))  # the drafters' steps, from the same count
    order = BatchOrder(len(examples), cfg.data.batch_size, cfg.run.seed)
    position = torch.zeros(5, dtype=torch.int64, device=device)
    dist.broadcast(position, src=schedule.drafter_ranks[0], group=startup)
    if ctx.role_rank == 0 and cfg.data.eval_path is not None:  # drafter 0's held-out features
        send_heldout(cfg, target, layer_ids, schedule.drafter_ranks[0], device, startup, log)
    _, epoch, cursor, first, end = position.tolist()  # the drafters' `batch_span`
    order.load_state_dict({"epoch": epoch, "cursor": cursor, "num_examples": len(examples), "batches": first})
    mine = schedule.target_batches(ctx.rank, first, end)
    log.emit("start", pid=os.getpid(), batches=len(mine), first_batch=first, device=str(device))
    reason = "completed"
    sent = 0
    waits = TargetWaits(log, cfg.run.log_every)
    for index in range(first, end):
        indices = order.next_batch()  # every batch advances the order, computed here or not
        if schedule.target_rank(index) != ctx.rank:
            continue
        if stop.requested:
            reason = f"signal {stop.signal_name}"
            send_end_markers(schedule, ctx.rank, index, end, device)
            break
        maybe_inject_failure(ctx, sent + 1)
        computing = time.perf_counter()
        features = step_features(target, [examples[i] for i in indices], capture_ids,
                                 cfg.model.target_rows_per_pass, device)
        if device.type == "cuda":  # the forward's own time, not its launch's: the send needs it done anyway
            torch.cuda.synchronize(device)
        sending = time.perf_counter()
        send_batch(schedule.drafter_ranks[schedule.drafter_role_rank(index)], index, **features)
        sent += 1
        waits.add(sending - computing, time.perf_counter() - sending)
    waits.flush()
    log.emit("stop", batches_sent=sent, reason=reason)
    return reason


class TargetWaits:
    """A target's time over each `every` batches it sends: computing them, blocked sending them (the
    drafter's queue is full) and the rest (waiting to be asked for the next), as a `waits` line
    (`batches, compute_s, send_s, wall_s`) that the launcher turns into the run's balance
    (dflash_ops.run.balance)."""

    def __init__(self, log: EventLog, every: int):
        self.log, self.every = log, max(1, every)
        self._reset()

    def _reset(self) -> None:
        self.batches, self.compute, self.send, self.since = 0, 0.0, 0.0, time.perf_counter()

    def add(self, compute_s: float, send_s: float) -> None:
        self.batches += 1
        self.compute += compute_s
        self.send += send_s
        if self.batches >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.batches:
            self.log.emit("waits", batches=self.batches, compute_s=round(self.compute, 4),
                          send_s=round(self.send, 4), wall_s=round(time.perf_counter() - self.since, 4))
        self._reset()


# --- entry point ---------------------------------------------------------------------------------
def attempt_store(ctx: WorkerContext) -> dist.Store:
    """torchrun's store (env:// rendezvous: MASTER_ADDR/PORT, torchrun's own rank 0 hosting it when
    it is not torchrun's), under a prefix of its own for each start of the group. In one container
    torchrun keeps one store for all its restarts, and the process group's keys (each rank's
    address) from an earlier start would otherwise be read as this start's. Across members each
    start has a new store (the launcher asks torchrun for that) and one prefix serves."""
    store, _, _ = next(rendezvous("env://", ctx.torchrun_rank, ctx.world_size, timeout=STARTUP_TIMEOUT))
    return dist.PrefixStore("dflash/start" if ctx.members > 1 else f"dflash/start-{ctx.restart}", store)


def run_worker(config_path: str, stop: StopSignal, log: WorkerLog,
               overrides: list[str] | None = None) -> None:
    """All a worker does. An exception goes to torchrun's error file on its way out (what `record`
    does, here before the process group is destroyed: a peer that loses this worker then reports
    only after it)."""
    errors = get_error_handler()
    errors.initialize()
    try:
        cfg = load_config(config_path, overrides=overrides or ())
        ctx = WorkerContext.from_env(cfg.pipeline)
        log.worker = ctx.name
        log.emit("worker_start", pid=os.getpid(), rank=ctx.rank, local_rank=ctx.local_rank,
                 restart=ctx.restart, gpus=list(ctx.gpus), error_file=os.environ.get(ERROR_FILE_ENV))
        torch.set_num_threads(cfg.pipeline.threads_per_worker)
        cuda = cfg.pipeline.device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError("pipeline.device", "'cuda' requested but this worker sees no CUDA device")
        device = torch.device("cuda", ctx.local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", store=attempt_store(ctx), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=PROCESS_GROUP_TIMEOUT)
        # Every rank, in the same order: the start's collectives wait STARTUP_TIMEOUT, the steps' the other.
        startup = dist.new_group(timeout=STARTUP_TIMEOUT)
        (run_drafter if ctx.role == "drafter" else run_target)(cfg, ctx, stop, device, startup)
    except Exception as exc:
        errors.record_exception(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(config_path: str, overrides: list[str] | None = None) -> int:
    stop = StopSignal().install()
    die_with_parent()  # torchrun puts workers in sessions of their own: none outlives it
    log = WorkerLog(0, f"rank {os.environ.get('RANK', '?')}")
    code = 1
    try:
        run_worker(config_path, stop, log, overrides)
        code = 0
    except (ConfigError, DataError, FileNotFoundError) as exc:
        log.emit("error", message=str(exc))
        print(f"{log.worker}: {exc}", file=sys.stderr)
        code = 2
    except Exception as exc:
        log.emit("error", message=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        log.emit("worker_exit", pid=os.getpid(), returncode=code)
        # The work is over. Python's shutdown puts the default (fatal) SIGTERM action back before
        # the process is gone; ignoring the signal instead keeps a late stop request from turning
        # a clean exit into a kill.
        for signum in (signal_module.SIGTERM, signal_module.SIGINT):
            signal_module.signal(signum, signal_module.SIG_IGN)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.run.pipeline",
        description="One worker of a pipeline run. Started by torchrun through the launcher (python -m "
                    "dflash_ops.train with a pipeline layout); torchrun sets RANK, LOCAL_RANK and "
                    "WORLD_SIZE.",
    )
    add_config_arguments(parser)
    _, config_path, overrides = parse_config_command(parser, argv)
    return worker_main(config_path, overrides)


if __name__ == "__main__":
    code = main()
    # Checkpoints are fsynced and the process group is destroyed by now. Tearing down an
    # interpreter that holds torch and transformers takes seconds and adds nothing for a worker
    # process, so flush the log and leave at once: a stop completes that much sooner.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
