"""Pipeline workers: target ranks feed packed hidden states to drafter ranks that train with DDP.

torchrun, started by the launcher (`dflash.launcher`), runs one `python -m dflash.pipeline --config
<yaml>` per worker with RANK, LOCAL_RANK and WORLD_SIZE set; the role follows from the global rank
(drafters first: rank 0 is drafter 0) and the device from LOCAL_RANK (`cuda:LOCAL_RANK`). Ranks
talk through `torch.distributed` (gloo on CPU, nccl on GPUs). When torchrun restarts the group
after a worker died, every worker resumes from the latest checkpoint.

Batch schedule. Batches are numbered i = 0, 1, 2... in the data order of a single-process run
(`BatchOrder`, resumed from the checkpoint's data position). Target rank j computes the batches
with i % T == j; batch i goes to drafter rank i % D, which trains on one batch per optimizer step
(D drafters: step s uses batches s*D .. s*D + D - 1, one per drafter, gradients averaged by DDP).
With one drafter the losses are those of the single-process trainer, bit for bit: same batches,
same target features, same initialisation and anchor RNG. With D > 1 each drafter's loss is the
weighted mean over its own batch and DDP averages the D gradients (a mean of per-rank means, not
one weighted mean over all D batches).

Flow control. Each drafter receives on a thread into a queue of `queue_depth` batches; the
target's send completes only when a receive is posted, so at most about queue_depth batches are
in flight per drafter and the slower side sets the pace.

Stopping. SIGTERM reaches every worker (from the launcher, or from torchrun when it stops the
group to restart it). A target
finishes the batch at hand, sends an end marker to each drafter that still expects batches from
it, and exits 0. Drafters agree (an all-reduce among them) to stop before the next step when any
of them was signalled or lost its feed, drafter 0 writes the checkpoint, and all drain what is
still in flight and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import signal as signal_module
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from dflash.cache_feed import cache_feed
from dflash.checkpoint import list_checkpoints, remove_partial_saves
from dflash.config import ConfigError, PipelineConfig, TrainConfig, load_config
from dflash.data import BatchOrder, DataError, collate, load_examples
from dflash.launcher import die_with_parent, first_rank, rank_table
from dflash.runtime import EventLog, StopSignal
from dflash.target import load_target, load_target_head, target_hidden_states
from dflash.train import DrafterRun
from dflash.training import StepResult, resolve_layer_ids

# A test knob: "<worker name>:<n>" makes that worker raise at its n-th batch (target) or step (drafter).
FAIL_ENV = "DFLASH_TEST_FAIL_AT"
HEADER_SIZE = 6  # kind, batch index, tokens, documents, feature width, dtype code
KIND_BATCH, KIND_END = 0, 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
FEED_DONE = "done"  # queue item: the schedule is over, or a target ended early
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class WorkerContext:
    """Who this worker is: its ranks from torchrun's environment, its role from the layout."""

    name: str
    role: str
    role_rank: int
    rank: int  # the run's global rank (`rank_table`): the member's first rank + LOCAL_RANK
    local_rank: int
    world_size: int
    drafter_ranks: tuple[int, ...]  # global ranks of drafter 0, 1...
    target_ranks: tuple[int, ...]  # global ranks of target 0, 1...
    member_leader: bool  # the first drafter of its member: logs steps, writes the member's checkpoints
    members: int
    torchrun_rank: int  # RANK as torchrun assigned it (members may join its rendezvous in any order)
    restart: int  # torchrun's restart count: 0 for the first start

    @classmethod
    def from_env(cls, pipeline: PipelineConfig) -> WorkerContext:
        env = os.environ
        try:
            rank, local_rank, world_size = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
        except KeyError as missing:
            raise SystemExit(f"dflash.pipeline: {missing} is not set; workers are started by torchrun "
                             "through the launcher (python -m dflash.train with a pipeline layout)") from None
        table = rank_table(pipeline)
        if world_size != len(table):
            raise ConfigError("pipeline", f"the run's layout has {len(table)} workers, torchrun started "
                              f"{world_size}")
        own = first_rank(pipeline) + local_rank
        name, role, role_rank, member = table[own]
        ranks = {r: tuple(i for i, row in enumerate(table) if row[1] == r) for r in ("drafter", "target")}
        leader = role == "drafter" and own == min(i for i in ranks["drafter"] if table[i][3] == member)
        return cls(name, role, role_rank, own, local_rank, world_size, ranks["drafter"], ranks["target"],
                   leader, len(pipeline.member_counts), rank, int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)

    def target_rank(self, batch_index: int) -> int:
        """Global rank of the target worker that computes batch `batch_index`."""
        return self.target_ranks[batch_index % self.num_targets]

    @staticmethod
    def drafter_rank(batch_index: int, num_drafters: int) -> int:
        """Role rank of the drafter that trains on batch `batch_index`."""
        return batch_index % num_drafters


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


class NoStatus:
    """Workers leave status.json to the launcher."""

    def update(self, **fields) -> None:
        pass


# --- transport -------------------------------------------------------------------------------------
def send_batch(dst: int, index: int, features: torch.Tensor, cu_seqlens: torch.Tensor,
               position_ids: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Three messages: a header, the int64 metadata, the `[T, k*H]` features."""
    n_tokens, width = features.shape
    device = features.device
    header = torch.tensor([KIND_BATCH, index, n_tokens, cu_seqlens.numel() - 1, width,
                           DTYPE_CODES[features.dtype]], dtype=torch.int64, device=device)
    ints = torch.cat([input_ids, loss_mask, position_ids, cu_seqlens.to(torch.int64)]).to(device, torch.int64)
    dist.send(header, dst)
    dist.send(ints, dst)
    dist.send(features.contiguous(), dst)


def end_marker(device: torch.device) -> torch.Tensor:
    return torch.tensor([KIND_END, -1, 0, 0, 0, 0], dtype=torch.int64, device=device)


def recv_batch(src: int, device: torch.device) -> dict | None:
    """The next batch from `src`, or None when `src` sent its end marker."""
    header = torch.empty(HEADER_SIZE, dtype=torch.int64, device=device)
    dist.recv(header, src)
    kind, index, n_tokens, n_docs, width, dtype_code = header.tolist()
    if kind == KIND_END:
        return None
    ints = torch.empty(3 * n_tokens + n_docs + 1, dtype=torch.int64, device=device)
    dist.recv(ints, src)
    features = torch.empty(n_tokens, width, dtype=CODE_DTYPES[dtype_code], device=device)
    dist.recv(features, src)
    input_ids, loss_mask, position_ids, cu_seqlens = ints.split([n_tokens, n_tokens, n_tokens, n_docs + 1])
    return {"index": index, "features": features, "cu_seqlens": cu_seqlens.to(torch.int32).cpu(),
            "position_ids": position_ids, "input_ids": input_ids, "loss_mask": loss_mask}


class BatchFeed:
    """A drafter's incoming batches: a receiving thread filling a bounded queue, in schedule order."""

    def __init__(self, ctx: WorkerContext, first_batch: int, end_batch: int, depth: int,
                 device: torch.device):
        self.ctx, self.device = ctx, device
        self.schedule = [i for i in range(first_batch, end_batch)
                         if ctx.drafter_rank(i, ctx.num_drafters) == ctx.role_rank]
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.draining = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive, name="batch-feed", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        while not self.draining.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def _receive(self) -> None:
        ended: set[int] = set()
        try:
            for index in self.schedule:
                src = self.ctx.target_rank(index)
                if src in ended:
                    continue
                batch = recv_batch(src, self.device)
                if batch is None:
                    if not ended:
                        self._put(FEED_DONE)  # the schedule is broken: train no further
                    ended.add(src)
                    if len(ended) == self.ctx.num_targets:
                        return
                elif not ended:
                    if batch["index"] != index:
                        raise RuntimeError(f"expected batch {index} from rank {src}, got {batch['index']}")
                    self._put(batch)
            if not ended:
                self._put(FEED_DONE)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self._put(FEED_DONE)

    def next(self, stop: StopSignal) -> dict | str | None:
        """The next batch, FEED_DONE, or None when a stop was requested while waiting."""
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError(f"receiving batches failed: {self.error}") from self.error
                if stop.requested:
                    return None

    def drain(self, timeout: float) -> None:
        """Receive (and drop) what the targets still send, so that none of them blocks for ever."""
        self.draining.set()
        self.thread.join(timeout)


# --- drafter ranks -------------------------------------------------------------------------------
class AgreedStop:
    """The drafters' stop decision, taken together before each step (an all-reduce of a flag) so
    that none of them enters a DDP step the others skip. Looks like the StopSignal the core's run
    loop polls; waiting for the step's batch happens here, since a missing batch means stop."""

    def __init__(self, signal: StopSignal, feed: BatchFeed, group, device: torch.device,
                 schedule_done: Callable[[], bool]):
        self.signal, self.feed, self.group, self.device = signal, feed, group, device
        self.schedule_done = schedule_done
        self.pending: dict | None = None
        self.decided = False

    @property
    def signal_name(self) -> str:
        return self.signal.signal_name or "none (a target ended the feed early)"

    @property
    def requested(self) -> bool:
        if self.decided:
            return True
        if self.schedule_done():  # the run loop ends on its own (max_steps_per_run); no batch will come
            return False
        if self.pending is None:
            item = self.feed.next(self.signal)
            self.pending = item if isinstance(item, dict) else None
        flag = torch.tensor([int(self.pending is None or self.signal.requested)], device=self.device)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.decided = bool(flag.item())
        return self.decided

    def take(self) -> dict:
        batch, self.pending = self.pending, None
        return batch

    def sleep(self, seconds: float) -> None:
        self.signal.sleep(seconds)


class DrafterDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP that still answers the drafter's own attributes (cfg, fc, logits...) for the trainer."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


class PipelineDrafterRun(DrafterRun):
    """The drafter side of the single-process run, fed by the target ranks. It holds only the
    target's head (embedding, lm_head, config), read from the target's weights without the model."""

    def __init__(self, cfg: TrainConfig, ctx: WorkerContext, log: EventLog, signal: StopSignal,
                 device: torch.device, group):
        head = load_target_head(cfg.model.target_path, cfg.model.dtype, device)
        super().__init__(cfg, NoStatus(), log, signal, head, rank=ctx.role_rank)
        self.ctx, self.group, self.signal = ctx, group, signal
        self.leader = ctx.role_rank == 0
        self.steps_done_here = 0
        # One writer of metrics.jsonl and the event files per member (each member's container has its own).
        self.telemetry.enabled = ctx.member_leader
        self.started_at = time.perf_counter()
        if self.leader and cfg.data.eval_path is not None:
            # Drafter 0 evaluates held-out data. The target's features of those examples are computed
            # once, by a target loaded on the CPU for that alone and freed before training starts: a
            # drafter GPU never holds the target.
            self.build_heldout(load_target(cfg.model.target_path, cfg.model.dtype, torch.device("cpu")))

    def attach(self, feed: BatchFeed, end_step: int) -> None:
        self.stop = AgreedStop(self.signal, feed, self.group, self.device,
                               schedule_done=lambda: self.trainer.step >= end_step)
        if self.group is not None:
            self.trainer.drafter = DrafterDDP(self.trainer.drafter, process_group=self.group)

    def random_states(self) -> list[dict]:
        """Every drafter's random state, gathered from all of them (a collective: every drafter
        saves at the same step)."""
        if self.group is None:
            return super().random_states()
        states: list = [None] * self.ctx.num_drafters
        dist.all_gather_object(states, self.random_state(), group=self.group)
        return states

    def save(self) -> None:
        """Each member's first drafter writes the checkpoint in its member's output dir (DDP keeps
        every drafter's weights and optimizer the same), with every drafter's random state."""
        if self.ctx.member_leader:
            super().save()
        else:
            self.random_states()  # the member leaders gather every drafter's random state
        self.last_saved_step = self.trainer.step

    def checkpoint_to_resume(self):
        """Across members: the latest step every member has a checkpoint of (a member whose last
        save a kill interrupted resumes with the others from the one before)."""
        if self.ctx.members == 1:
            return super().checkpoint_to_resume()
        remove_partial_saves(self.output_dir)
        found = {int(p.name.rpartition("-")[2]): p for p in list_checkpoints(self.output_dir)}
        everyone: list = [None] * self.ctx.num_drafters
        dist.all_gather_object(everyone, sorted(found) if self.cfg.run.resume else [], group=self.group)
        common = set.intersection(*(set(steps) for steps in everyone))
        if not common and any(everyone):
            raise RuntimeError(f"the members have no checkpoint step in common (each drafter's steps, in "
                               f"role rank order: {everyone}); move the checkpoints aside to start over")
        return found[max(common)] if common else None

    def train_one_step(self) -> StepResult:
        maybe_inject_failure(self.ctx, self.trainer.step + 1)
        for _ in range(self.ctx.num_drafters):  # the data position the checkpoint records
            self.order.next_batch()
        batch = self.stop.take()
        result = self.trainer.train_step(batch["features"], batch["cu_seqlens"], batch["position_ids"],
                                         batch["input_ids"], batch["loss_mask"])
        if self.group is None:
            return result
        # Report the mean loss/accuracy and the tokens of all drafters.
        figures = torch.tensor([result.loss, result.accuracy, result.num_tokens], dtype=torch.float64,
                               device=self.device)
        dist.all_reduce(figures, group=self.group)
        n = self.ctx.num_drafters
        return dataclasses.replace(result, loss=figures[0].item() / n, accuracy=figures[1].item() / n,
                                   num_tokens=int(figures[2].item()))


def run_drafter(cfg: TrainConfig, ctx: WorkerContext, signal: StopSignal, device: torch.device) -> str:
    group = drafter_group(ctx)
    log = WorkerLog(cfg.optim.total_steps, ctx.name, ctx.member_leader)
    run = PipelineDrafterRun(cfg, ctx, log, signal, device, group if ctx.num_drafters > 1 else None)
    run.resume()
    first_step = run.trainer.step
    position = torch.tensor([first_step, run.order.epoch, run.order.cursor], dtype=torch.int64, device=device)
    dist.broadcast(position, src=ctx.drafter_ranks[0])
    last_step = run_end_step(cfg, first_step)
    first, end = first_step * ctx.num_drafters, last_step * ctx.num_drafters
    feed = (cache_feed(cfg, run.order, first, end, ctx.role_rank, ctx.num_drafters) if cfg.data.features_path
            else BatchFeed(ctx, first, end, cfg.pipeline.queue_depth, device))
    run.attach(feed, last_step)
    try:
        reason = run.run()
    except BaseException:
        feed.drain(timeout=1)
        raise
    # Checkpointed: say so first (the launcher then stops the targets), then let the targets finish.
    run.log.emit("stop", step=run.trainer.step, reason=reason)
    feed.drain(timeout=60)
    if feed.error is not None:
        raise RuntimeError(f"receiving batches failed: {feed.error}") from feed.error
    return reason


def drafter_group(ctx: WorkerContext):
    """The drafters' own process group (DDP and the stop vote); every rank must create it."""
    return dist.new_group(ranks=list(ctx.drafter_ranks))


def run_end_step(cfg: TrainConfig, first_step: int) -> int:
    """The optimizer step this process stops after: the end of training or of the per-run budget."""
    end = cfg.optim.total_steps
    if cfg.run.max_steps_per_run is not None:
        end = min(end, first_step + cfg.run.max_steps_per_run)
    return max(end, first_step)


# --- target ranks --------------------------------------------------------------------------------
def run_target(cfg: TrainConfig, ctx: WorkerContext, signal: StopSignal, device: torch.device) -> str:
    log = WorkerLog(cfg.optim.total_steps, ctx.name)
    drafter_group(ctx)
    target = load_target(cfg.model.target_path, cfg.model.dtype, device)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    examples = load_examples(cfg.data.path, cfg.data.max_length, target.config.vocab_size)
    order = BatchOrder(len(examples), cfg.data.batch_size, cfg.run.seed)
    position = torch.zeros(3, dtype=torch.int64, device=device)
    dist.broadcast(position, src=ctx.drafter_ranks[0])
    first_step, epoch, cursor = position.tolist()
    order.load_state_dict({"epoch": epoch, "cursor": cursor, "num_examples": len(examples)})
    first, end = first_step * ctx.num_drafters, run_end_step(cfg, first_step) * ctx.num_drafters
    mine = [i for i in range(first, end) if ctx.target_rank(i) == ctx.rank]
    log.emit("start", pid=os.getpid(), batches=len(mine), first_batch=first, device=str(device))
    reason = "completed"
    sent = 0
    for index in range(first, end):
        indices = order.next_batch()  # every batch advances the order, computed here or not
        if ctx.target_rank(index) != ctx.rank:
            continue
        if signal.requested:
            reason = f"signal {signal.signal_name}"
            send_end_markers(ctx, index, end, device)
            break
        maybe_inject_failure(ctx, sent + 1)
        batch = {k: t.to(device) for k, t in collate([examples[i] for i in indices]).items()}
        packed = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layer_ids,
                                      cfg.model.target_rows_per_pass)
        drafter = ctx.drafter_ranks[ctx.drafter_rank(index, ctx.num_drafters)]
        send_batch(drafter, index, packed.features, packed.cu_seqlens, packed.position_ids,
                   packed.pack(batch["input_ids"]), packed.pack(batch["loss_mask"]))
        sent += 1
    log.emit("stop", batches_sent=sent, reason=reason)
    return reason


def send_end_markers(ctx: WorkerContext, index: int, end: int, device: torch.device) -> None:
    """Tell each drafter that still expects a batch from this target (from `index` on) that none
    will come; all at once, since each drafter receives in its own order."""
    waiting = sorted({ctx.drafter_rank(i, ctx.num_drafters) for i in range(index, end)
                      if ctx.target_rank(i) == ctx.rank})
    works = [dist.isend(end_marker(device), ctx.drafter_ranks[dst]) for dst in waiting]
    for work in works:
        work.wait()


# --- entry point ---------------------------------------------------------------------------------
def attempt_store(ctx: WorkerContext) -> dist.Store:
    """torchrun's store (env:// rendezvous: MASTER_ADDR/PORT, torchrun's own rank 0 hosting it when
    it is not torchrun's), under a prefix of its own for each start of the group. In one container
    torchrun keeps one store for all its restarts, and the process group's keys (each rank's
    address) from an earlier start would otherwise be read as this start's. Across members each
    start has a new store (the launcher asks torchrun for that) and one prefix serves."""
    store, _, _ = next(rendezvous("env://", ctx.torchrun_rank, ctx.world_size, timeout=PROCESS_GROUP_TIMEOUT))
    return dist.PrefixStore("dflash/start" if ctx.members > 1 else f"dflash/start-{ctx.restart}", store)


def worker_main(config_path: str) -> int:
    signal = StopSignal().install()
    die_with_parent()  # torchrun puts workers in sessions of their own: none outlives it
    name = f"rank {os.environ.get('RANK', '?')}"
    log = WorkerLog(0, name)
    code = 1
    try:
        cfg = load_config(config_path)
        ctx = WorkerContext.from_env(cfg.pipeline)
        log = WorkerLog(0, ctx.name)
        log.emit("worker_start", pid=os.getpid(), rank=ctx.rank, local_rank=ctx.local_rank,
                 restart=ctx.restart)
        torch.set_num_threads(cfg.pipeline.threads_per_worker)
        cuda = cfg.pipeline.device == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError("pipeline.device", "'cuda' requested but this worker sees no CUDA device")
        device = torch.device("cuda", ctx.local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", store=attempt_store(ctx), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=PROCESS_GROUP_TIMEOUT)
        try:
            if ctx.role == "drafter":
                run_drafter(cfg, ctx, signal, device)
            else:
                run_target(cfg, ctx, signal, device)
        finally:
            dist.destroy_process_group()
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
        prog="python -m dflash.pipeline",
        description="One worker of a pipeline run. Started by torchrun through the launcher (python -m "
                    "dflash.train with a pipeline layout); torchrun sets RANK, LOCAL_RANK and WORLD_SIZE.",
    )
    parser.add_argument("--config", required=True, help="path to the YAML training config")
    args = parser.parse_args(argv)
    return worker_main(args.config)


if __name__ == "__main__":
    code = main()
    # Checkpoints are fsynced and the process group is destroyed by now. Tearing down an
    # interpreter that holds torch and transformers takes seconds and adds nothing for a worker
    # process, so flush the log and leave at once: a stop completes that much sooner.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
