"""Entry point: `python -m dflash.train --config <yaml>`.

Single process: the frozen target and the drafter live in this process and take turns each step.
SIGTERM (or SIGINT) lets the current step finish, then the run saves a checkpoint, writes status
`stopped`, logs a `stop` event and exits 0: the stop takes at most one step plus one checkpoint
save (a `run.step_delay` pause is cut short), which is what a stop timeout must allow for.
Exit codes: 0 done or stopped, 1 crashed, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from dflash.checkpoint import (
    keep_trained_mask_token,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_saves,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash.config import ConfigError, TrainConfig, dump_config, load_config
from dflash.data import BatchOrder, DataError, collate, load_examples
from dflash.heldout import HeldOutEvaluator
from dflash.runtime import EventLog, StatusFile, StopSignal
from dflash.safe_paths import UnsafePath
from dflash.target import TargetHead, load_target, target_hidden_states
from dflash.telemetry import IntervalMeter, RunTelemetry
from dflash.training import DrafterTrainer, StepResult, build_drafter, resolve_layer_ids

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT = 0, 1, 2


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("pipeline.device", "'cuda' requested but no CUDA device is visible")
    return torch.device("cuda" if name == "cuda" else "cpu")


class DrafterRun:
    """The drafter side of a run: the trainer, the data order and the run's outputs, around the
    target's `head` (embedding, lm_head, config). `train_one_step` is the subclass's: it brings
    the step's target features.

    Checkpoints hold every drafter rank's random state (`random_states`, in rank order: its anchor
    RNG and the process RNGs), and each rank resumes from its own, so that a resumed run draws
    what the uninterrupted one would have, whatever the number of drafters."""

    def __init__(self, cfg: TrainConfig, status: StatusFile, log: EventLog, stop: StopSignal,
                 head: TargetHead, rank: int = 0):
        self.cfg, self.status, self.log, self.stop = cfg, status, log, stop
        self.output_dir = Path(cfg.run.output_dir)
        self.rank = rank
        self.device = head.embed_tokens.weight.device
        self.layer_ids = resolve_layer_ids(cfg, head.config.num_hidden_layers)
        self.examples = load_examples(cfg.data.path, cfg.data.max_length, head.config.vocab_size)
        self.order = BatchOrder(len(self.examples), cfg.data.batch_size, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)  # the drafter's initial weights: the same on every rank
        random.seed(cfg.run.seed)
        self.trainer = DrafterTrainer(build_drafter(cfg, head), cfg, rank)
        self.last_saved_step: int | None = None
        self.meter = IntervalMeter()
        self.telemetry = RunTelemetry(self.output_dir,
                                      warn=lambda message: self.log.emit("warning", message=message))
        self.vocab_size = head.config.vocab_size
        self.heldout = None

    def build_heldout(self, target) -> None:
        """Held-out evaluation of the config's `data.eval_path` (if any): the target's features of
        those examples are computed once, here, by `target` (the run's own, or one loaded for this)."""
        cfg = self.cfg
        held_out = load_examples(cfg.data.eval_path, cfg.data.max_length, self.vocab_size)
        self.heldout = HeldOutEvaluator(target, held_out[: cfg.data.eval_examples], self.layer_ids,
                                        cfg.data.max_anchors, cfg.gamma)

    def random_state(self) -> dict:
        """This rank's random state: its anchor RNG and the process RNGs."""
        return {"anchor": self.trainer.anchor_generator.get_state(), **rng_state()}

    def random_states(self) -> list[dict]:
        """Every drafter rank's random state, in rank order (here: this rank only)."""
        return [self.random_state()]

    def checkpoint_to_resume(self) -> Path | None:
        remove_partial_saves(self.output_dir)
        return latest_checkpoint(self.output_dir) if self.cfg.run.resume else None

    def resume(self) -> None:
        checkpoint = self.checkpoint_to_resume()
        if checkpoint is None:
            return
        model_state, state, meta = load_checkpoint(checkpoint)
        keep_trained_mask_token(self.trainer.drafter.cfg, meta, self.cfg.model.mask_token_id)
        self.trainer.drafter.load_trainable_state_dict(model_state)
        self.trainer.load_state_dict(state["trainer"])
        self.order.load_state_dict(state["data"])
        ranks = state["rng"]
        if isinstance(ranks, dict):  # written before the random state was kept per rank
            ranks = [{**ranks, "anchor": state["trainer"]["anchor_rng"]}]
        own = ranks[self.rank] if self.rank < len(ranks) else None
        if own is not None:  # a rank the checkpoint's layout did not have keeps its fresh seed
            self.trainer.anchor_generator.set_state(own["anchor"])
            set_rng_state(own)
        self.last_saved_step = self.trainer.step
        self.status.update(last_checkpoint=str(checkpoint))
        self.log.emit("resume", step=self.trainer.step, checkpoint=str(checkpoint),
                      saved_ranks=len(ranks))

    def save(self) -> None:
        step = self.trainer.step
        drafter = self.trainer.drafter
        meta = {"layer_ids": self.layer_ids, "drafter_config": dataclasses.asdict(drafter.cfg),
                "target_path": self.cfg.model.target_path, "dtype": self.cfg.model.dtype}
        state = {"trainer": self.trainer.state_dict(), "data": self.order.state_dict(),
                 "rng": self.random_states()}
        try:
            path = save_checkpoint(self.output_dir, step, drafter.trainable_state_dict(), state,
                                   dump_config(self.cfg), meta, self.cfg.run.keep_checkpoints)
        except OSError as exc:  # a full disk: the run goes on, and says so
            last = latest_checkpoint(self.output_dir)
            message = (f"checkpoint step {step} could not be written in {self.output_dir}/checkpoints "
                       f"({exc.strerror or exc}); nothing of it was kept, the last complete checkpoint is "
                       f"{last.name if last else 'none'}; the next save tries again")
            self.status.update(checkpoint_error=message)
            self.log.emit("checkpoint_failed", step=step, message=message)
            return
        self.last_saved_step = step
        self.status.update(last_checkpoint=str(path), checkpoint_error=None)
        self.log.emit("checkpoint", step=step, path=str(path))

    def train_one_step(self) -> StepResult:
        raise NotImplementedError

    def evaluate_heldout(self) -> None:
        """Held-out loss and tau of the drafter now: logged, recorded and shown in status.json."""
        started = time.perf_counter()
        drafter = getattr(self.trainer.drafter, "module", self.trainer.drafter)  # unwrapped from DDP
        fields = self.heldout(drafter).as_fields()
        seconds = round(time.perf_counter() - started, 3)
        self.log.emit("heldout", step=self.trainer.step, seconds=seconds, **fields)
        self.telemetry.record("heldout", self.trainer.step, {**fields, "seconds": seconds})
        self.status.update(heldout_loss=fields["heldout_loss"], heldout_tau=fields["heldout_tau"])

    def run(self) -> str:
        """Train until done, stopped, or the per-run step budget is spent; return why it ended."""
        run_cfg, total = self.cfg.run, self.cfg.optim.total_steps
        self.log.emit("start", step=self.trainer.step, total_steps=total, pid=os.getpid(),
                      device=str(self.device), target_layer_ids=self.layer_ids, examples=len(self.examples))
        self.status.update(state="running", step=self.trainer.step)
        steps_this_run = 0
        reason = "completed"
        while self.trainer.step < total:
            if self.stop.requested:
                reason = f"signal {self.stop.signal_name}"
                break
            if run_cfg.max_steps_per_run is not None and steps_this_run >= run_cfg.max_steps_per_run:
                reason = "max_steps_per_run"
                break
            started = time.perf_counter()
            result = self.train_one_step()
            steps_this_run += 1
            seconds = time.perf_counter() - started
            self.meter.add(result, seconds)
            if result.step % run_cfg.log_every == 0 or result.step == total:
                # Means over the steps since the last line, not the last step's figures.
                figures = self.meter.flush()
                self.log.emit("step", step=result.step, lr=result.lr, blocks=result.num_blocks, **figures)
                self.telemetry.record("train", result.step, {**figures, "lr": result.lr})
                self.status.update(step=result.step, loss=figures["loss"], accuracy=figures["accuracy"],
                                   tokens_per_s=figures["tokens_per_s"])
            self.log.show_progress(result.step, result.loss, result.num_tokens / max(seconds, 1e-9))
            if self.heldout is not None and (result.step % run_cfg.eval_every == 0 or result.step == total):
                self.evaluate_heldout()
            if result.step % run_cfg.save_every == 0:
                self.save()
            self.stop.sleep(run_cfg.step_delay)
        self.status.update(state="stopping", step=self.trainer.step)
        if self.last_saved_step != self.trainer.step:
            self.save()
        self.telemetry.close()
        return reason


class SingleProcessRun(DrafterRun):
    """The frozen target and the drafter in one process, taking turns each step."""

    def __init__(self, cfg: TrainConfig, status: StatusFile, log: EventLog, stop: StopSignal):
        self.target = load_target(cfg.model.target_path, cfg.model.dtype, resolve_device(cfg.pipeline.device))
        super().__init__(cfg, status, log, stop, TargetHead.of(self.target))
        if cfg.data.eval_path is not None:
            self.build_heldout(self.target)

    def train_one_step(self) -> StepResult:
        batch = collate([self.examples[i] for i in self.order.next_batch()])
        batch = {name: t.to(self.device) for name, t in batch.items()}
        packed = target_hidden_states(self.target, batch["input_ids"], batch["attention_mask"],
                                      self.layer_ids, self.cfg.model.target_rows_per_pass)
        return self.trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                       packed.pack(batch["input_ids"]), packed.pack(batch["loss_mask"]))


def run_single_process(cfg: TrainConfig) -> int:
    """Run the whole training in this process; return the exit code."""
    torch.set_num_threads(cfg.pipeline.threads_per_worker)
    worker = {"state": "starting", "pid": os.getpid(), "gpus": []}
    status = StatusFile(cfg.run.output_dir, workers={"trainer": worker})
    log = EventLog(cfg.optim.total_steps, on_log_error=lambda message: status.update(log_error=message))
    stop = StopSignal().install()
    try:
        status.update(state="starting")
        run = SingleProcessRun(cfg, status, log, stop)
        run.resume()
        worker["state"] = "running"
        reason = run.run()
        worker["state"] = "stopped"
        status.update(state="stopped", step=run.trainer.step, stop_reason=reason)
        log.emit("stop", step=run.trainer.step, reason=reason)
        return EXIT_OK
    except (ConfigError, DataError, FileNotFoundError, UnsafePath) as exc:
        worker["state"] = "failed"
        status.update(state="failed", error=str(exc))
        log.emit("error", message=str(exc))
        print(f"dflash.train: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        worker["state"] = "failed"
        status.update(state="failed", error=f"{type(exc).__name__}: {exc}")
        log.emit("error", message=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return EXIT_CRASH
    finally:
        stop.restore()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.train",
                                     description="Train a DFlash drafter for a frozen target model.")
    parser.add_argument("--config", required=True,
                        help="path to the YAML training config (see docs/CONTRACTS.md)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid config {args.config}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if cfg.pipeline.is_multi_process:
        from dflash.launcher import launch

        return launch(cfg, args.config)
    return run_single_process(cfg)


if __name__ == "__main__":
    sys.exit(main())
