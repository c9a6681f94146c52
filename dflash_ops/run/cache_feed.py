"""Training from a feature cache (`data.features_path`, written by `python -m dflash_ops.capture`).

- `FeatureCache` maps each shard of a cache (`dflash_ops.data.feature_cache` has the format) and knows
  where each example's document lies; `batch(indices)` gives what the online target gives for
  those examples, packed: `features` [T, k*H] in the model dtype, `cu_seqlens` [B+1] int32,
  `position_ids`, `input_ids` and `loss_mask` [T] int64. The features of a batch are one copy out
  of the mapped pages (private mappings: nothing is ever written back).
- `CacheFeed` is a drafter's batches in schedule order, read on a thread `pipeline.queue_depth`
  batches ahead: batch i of the run's data order goes to drafter i % D, as in the pipeline. It
  answers like the pipeline's feed of target batches (dflash_ops.run.transport's `BatchFeed`: `next(stop)`
  gives a step's keyword arguments or FEED_DONE, `drain(timeout)`, `error`); `last_index` and
  `last_indices` say which batch the last one was.
- `CachedFeatures` is the single-process run's batch source from the cache (in place of the
  target): the run holds only the target's head (embedding, lm_head), and the data order, anchors,
  optimizer, checkpoints and resume are the run's own, so a resumed run continues exactly. In the
  first epoch the features are those the online target computes for the same batches, bit for bit on CPU (the
  capture ran the target on them); in later epochs a document's features are the ones of its
  capture batch (another padded length: equal up to the target's rounding).
"""

from __future__ import annotations

import math
import mmap
import queue
import threading
from pathlib import Path

import torch

from dflash_ops.core.config import ConfigError, TrainConfig
from dflash_ops.core.runtime import EventLog, StopSignal
from dflash_ops.data.examples import BatchOrder
from dflash_ops.data.feature_cache import KEY, check_cache, read_manifest, read_shard_header
from dflash_ops.data.target import load_target, load_target_head
from dflash_ops.run.transport import FEED_DONE
from dflash_ops.training.drafter_run import DrafterRun

TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                "U8": torch.uint8}


class Shard:
    """One shard file, mapped: its tensors are views of the mapping."""

    def __init__(self, path: Path, planned: dict, width: int):
        with path.open("rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tensors = {}
        for name, (code, shape, begin, end) in read_shard_header(path).items():
            if end > len(self.map):
                raise ValueError(f"{path}: tensor {name} ends at byte {end}, past the file's {len(self.map)}")
            dtype, count = TORCH_DTYPES[code], math.prod(shape)
            view = torch.frombuffer(self.map, dtype=dtype, count=count, offset=begin) if count else \
                torch.empty(0, dtype=dtype)
            self.tensors[name] = view.view(shape)
        found = (tuple(self.tensors["features"].shape), self.tensors["example_ids"].numel())
        if found != ((planned["tokens"], width), planned["documents"]):
            raise ValueError(f"{path}: holds {found[0]} features of {found[1]} documents, the manifest says "
                             f"({planned['tokens']}, {width}) of {planned['documents']}")


class FeatureCache:
    """A finished feature cache, read by example index (the data set's line order)."""

    def __init__(self, path: str | Path):
        self.root = Path(path)
        self.manifest = read_manifest(self.root)
        width = self.manifest["width"]
        try:
            self.shards = [Shard(self.root / s["name"], s, width) for s in self.manifest["shards"]]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(KEY, f"{exc}; remove the shard and run python -m dflash_ops.capture again"
                              ) from exc
        self.location: list[tuple[int, int, int] | None] = [None] * self.manifest["dataset"]["examples"]
        for k, shard in enumerate(self.shards):
            bounds = shard.tensors["cu_seqlens"].tolist()
            for d, example in enumerate(shard.tensors["example_ids"].tolist()):
                self.location[example] = (k, bounds[d], bounds[d + 1])
        missing = [i for i, where in enumerate(self.location) if where is None]
        if missing:
            raise ConfigError(KEY, f"{self.root} has no features of examples {missing[:8]} "
                              f"({len(missing)} in all): capture again")

    def __len__(self) -> int:
        return len(self.location)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The packed batch of these examples, as the online target and packing give it."""
        parts = [self.location[i] for i in indices]

        def gather(name: str) -> torch.Tensor:
            return torch.cat([self.shards[k].tensors[name][start:end] for k, start, end in parts])

        cu_seqlens = torch.zeros(len(parts) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor([end - start for _, start, end in parts]), 0)
        return {"features": gather("features"), "cu_seqlens": cu_seqlens,
                "position_ids": gather("position_ids").to(torch.int64),
                "input_ids": gather("input_ids").to(torch.int64),
                "loss_mask": gather("loss_mask").to(torch.int64)}


class CacheFeed:
    """Batches `first_batch` .. `end_batch` - 1 (None: no end) of the data order that continues
    from `order`'s position, those of drafter `drafter_rank` of `num_drafters`, read on a thread
    into a queue of `depth`."""

    def __init__(self, cache: FeatureCache, order: BatchOrder, first_batch: int, end_batch: int | None,
                 drafter_rank: int, num_drafters: int, depth: int):
        self.cache = cache
        self.order = BatchOrder(order.num_examples, order.batch_size, order.seed)
        self.order.load_state_dict(order.state_dict())
        self.first, self.end = first_batch, end_batch
        self.rank, self.drafters = drafter_rank, num_drafters
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.last_index: int | None = None
        self.last_indices: list[int] | None = None
        self.draining = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, name="cache-feed", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.draining.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _read(self) -> None:
        index = self.first
        try:
            while self.end is None or index < self.end:
                indices = self.order.next_batch()  # every batch advances the order, this drafter's or not
                if index % self.drafters == self.rank:
                    if not self._put((index, indices, self.cache.batch(indices))):
                        return
                index += 1
            self._put(FEED_DONE)
        except BaseException as exc:  # reported by the consumer
            self.error = exc
            self._put(FEED_DONE)

    def next(self, stop: StopSignal) -> dict | str | None:
        """The next batch (a step's keyword arguments), FEED_DONE, or None when a stop was requested
        while waiting."""
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if stop.requested:
                    return None
                continue
            if self.error is not None:
                raise RuntimeError(f"reading the feature cache failed: {self.error}") from self.error
            if item == FEED_DONE:
                return item
            self.last_index, self.last_indices, batch = item
            return batch

    def drain(self, timeout: float) -> None:
        """Stop reading ahead."""
        self.draining.set()
        self.thread.join(timeout)


def cache_feed(cfg: TrainConfig, order: BatchOrder, first_batch: int, end_batch: int | None,
               drafter_rank: int, num_drafters: int) -> CacheFeed:
    """The feed of a drafter of `cfg`'s run from its feature cache."""
    return CacheFeed(FeatureCache(cfg.data.features_path), order, first_batch, end_batch, drafter_rank,
                     num_drafters, cfg.pipeline.queue_depth)


class _NoStop:
    requested = False


class CachedFeatures:
    """The single process's batch source from its feature cache: the next batch of the run's data
    order, read ahead on a thread, unless a stop was requested."""

    def __init__(self, cfg: TrainConfig, run: DrafterRun):
        self.run = run
        # Made after the resume: the feed continues the run's data order from its position.
        self.feed = CacheFeed(FeatureCache(cfg.data.features_path), run.order, 0, None, 0, 1,
                              cfg.pipeline.queue_depth)
        self.stop_reason = ""

    def next_batch(self, stop: StopSignal) -> dict | None:
        if stop.requested:
            self.stop_reason = f"signal {stop.signal_name}"
            return None
        indices = self.run.order.next_batch()  # the position the checkpoint records
        batch = self.feed.next(_NoStop())  # the batch is taken from the order: wait for it
        if self.feed.last_indices != indices:
            raise RuntimeError(f"the cache feed is out of step: {indices} expected, "
                               f"{self.feed.last_indices} read")
        return batch

    def close(self) -> None:
        self.feed.drain(timeout=10)


def cached_run(cfg: TrainConfig, log: EventLog, device: torch.device) -> tuple[DrafterRun, CachedFeatures]:
    """The single-process run of `cfg` fed by its feature cache, resumed, and its batch source."""
    check_cache(cfg, checksums=cfg.data.features_verify == "checksums")
    run = DrafterRun(cfg, log, load_target_head(cfg.model.target_path, cfg.model.dtype, device))
    if cfg.data.eval_path is not None:
        # The held-out examples' features, computed once by a target loaded for that alone.
        run.build_heldout(load_target(cfg.model.target_path, cfg.model.dtype, device))
    run.resume()
    return run, CachedFeatures(cfg, run)
