"""The drafter side of a run, in either layout: resume, the step loop, held-out evaluation, checkpoints.

`DrafterRun` trains one drafter rank around the target's head (embedding, lm_head, config). What
differs between the layouts comes in as parts, not as subclasses:

- `drafters`, the run's drafter ranks as this one sees them: `SoleDrafter` (one drafter: rank 0,
  nothing to exchange) or a pipeline's `DrafterGroup` (dflash_ops.run.pipeline: the drafters' process group,
  through which DDP averages gradients, random states are gathered for a checkpoint and the step's
  figures are averaged);
- the batch source of `run(source, stop)`: `source.next_batch(stop)` gives each step's packed target
  features (the keyword arguments of `DrafterTrainer.train_step`), or None when the run must stop,
  `source.stop_reason` then saying why. The single process computes them with its own target
  (dflash_ops.train); a pipeline's drafter receives them from the target ranks, and the drafters agree
  before each step whether to take it (dflash_ops.run.pipeline). `stop` is the process's StopSignal.

Checkpoints hold every drafter rank's random state (in rank order: its anchor RNG and the process
RNGs), and each rank resumes from its own, so that a resumed run draws what the uninterrupted one
would have, whatever the number of drafters. The run reports through its log alone (`start`,
`step`, `heldout`, `checkpoint`, `resume`); status.json follows the log (dflash_ops.run.status).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path

import torch

from dflash_ops.core.config import TrainConfig, dump_config, with_examples
from dflash_ops.core.runtime import EventLog
from dflash_ops.data.data_manifest import check_thinking_mode
from dflash_ops.data.examples import BatchOrder, load_examples, training_examples
from dflash_ops.data.target import TargetHead
from dflash_ops.training.best_checkpoint import best_step_to_keep
from dflash_ops.training.checkpoint import (
    check_loss_weighting,
    check_step_plan,
    fit_to_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_saves,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_ops.training.checkpoint_writer import CheckpointWriter
from dflash_ops.training.heldout import HeldOutEvaluator
from dflash_ops.training.mlflow_tracking import track
from dflash_ops.training.resume_check import config_changes, describe
from dflash_ops.training.telemetry import IntervalMeter, RunTelemetry
from dflash_ops.training.trainer import (
    DrafterTrainer,
    StepResult,
    build_drafter,
    compute_precision,
    resolve_layer_ids,
)


def data_store(examples) -> str | None:
    """The token store the run reads its rows from (dflash_ops.core.token_store), None for parsed JSON
    lines."""
    store = getattr(examples, "store", None)
    return None if store is None else str(store.path)


def heldout_examples(cfg: TrainConfig, vocab_size: int) -> list:
    """The held-out examples a run evaluates: the first `data.eval_examples` of `data.eval_path`."""
    return load_examples(cfg.data.eval_path, cfg.data.max_length, vocab_size)[: cfg.data.eval_examples]


def latest_to_resume(output_dir: Path, resume: bool) -> Path | None:
    """The checkpoint a run resumes from: its latest complete one (partial saves removed first)."""
    remove_partial_saves(output_dir)
    return latest_checkpoint(output_dir) if resume else None


class SoleDrafter:
    """The drafter ranks of a run with one drafter: this one, rank 0, which writes the run's files."""

    rank = 0
    process_group = None  # no DDP
    writes_files = True  # the checkpoints, metrics.jsonl and the TensorBoard files

    def gather(self, obj) -> list:
        return [obj]

    def any(self, flag: bool) -> bool:
        return flag

    def mean(self, result: StepResult) -> StepResult:
        return result

    def checkpoint_to_resume(self, output_dir: Path, resume: bool) -> Path | None:
        return latest_to_resume(output_dir, resume)


class DrafterRun:
    def __init__(self, cfg: TrainConfig, log: EventLog, head: TargetHead, drafters=None):
        self.examples = training_examples(cfg.data, head.config.vocab_size)
        # The run's steps follow from the examples it loaded (optim.epochs); `self.cfg.total_steps` is them.
        self.cfg = cfg = with_examples(cfg, len(self.examples))
        self.log = log
        log.total_steps = cfg.total_steps
        self.drafters = drafters or SoleDrafter()
        self.output_dir = Path(cfg.run.output_dir)
        self.device = head.embed_tokens.weight.device
        self.layer_ids = resolve_layer_ids(cfg, head.config.num_hidden_layers)
        self.order = BatchOrder(len(self.examples), cfg.data.batch_size, cfg.run.seed)
        torch.manual_seed(cfg.run.seed)  # the drafter's initial weights: the same on every rank
        random.seed(cfg.run.seed)
        self.trainer = DrafterTrainer(build_drafter(cfg, head), cfg, self.drafters.rank,
                                      self.drafters.process_group)
        self.last_saved_step: int | None = None
        self.checkpoint_error: str | None = None  # why the latest save failed (None once one succeeds)
        # Checkpoints are written on a thread (dflash_ops.training.checkpoint_writer): the step of the
        # save whose outcome the drafters have not yet agreed on, and whether this rank's write failed.
        self.writer = CheckpointWriter()
        self.unsettled_save: int | None = None
        self.save_failed = False
        self.meter = IntervalMeter()
        warn = lambda message: self.log.emit("warning", message=message)  # noqa: E731
        # metrics.jsonl and TensorBoard; MLflow too when the config names a server (else nothing imported).
        self.telemetry = track(RunTelemetry(self.output_dir, enabled=self.drafters.writes_files, warn=warn),
                               cfg, enabled=self.drafters.writes_files, warn=warn)
        self.vocab_size = head.config.vocab_size
        self.heldout = None
        self.heldout_taus: dict[int, float] = {}  # this process's, by step (run.keep_best)
        # Whether a data manifest confirmed data.enable_thinking (the checkpoints' meta says so).
        self.thinking_confirmed = check_thinking_mode(cfg)

    def build_heldout(self, target=None, documents=None) -> None:
        """Held-out evaluation of the config's `data.eval_path`: the target's features of those
        examples are computed once, here by `target` (the run's own, or one loaded for this), or
        elsewhere (a pipeline's target rank 0) and given as `documents` (`heldout_documents`)."""
        cfg = self.cfg
        settings = (cfg.data.max_anchors, cfg.gamma, cfg.model.loss_chunk_size,
                    lambda device: compute_precision(cfg, device), cfg.model.attention_backend)
        if documents is not None:
            self.heldout = HeldOutEvaluator(documents, *settings)
            return
        self.heldout = HeldOutEvaluator.of(target, heldout_examples(cfg, self.vocab_size), self.layer_ids,
                                           *settings)

    def random_state(self) -> dict:
        """This rank's random state: its anchor RNG and the process RNGs."""
        return {"anchor": self.trainer.anchor_generator.get_state(), **rng_state()}

    def resume(self) -> None:
        checkpoint = self.drafters.checkpoint_to_resume(self.output_dir, self.cfg.run.resume)
        if checkpoint is None:
            return
        model_state, state, meta = load_checkpoint(checkpoint)
        fit_to_checkpoint(self.trainer.drafter.cfg, meta, self.cfg.model.mask_token_id)
        check_loss_weighting(self.cfg.loss_weighting, meta)
        total = check_step_plan(self.cfg, meta)  # an optim.epochs run: to the end of its epochs
        if total is not None and total != self.cfg.total_steps:  # another layout: elastic (docs/CONTRACTS.md)
            then = meta["step_plan"]
            self.log.emit("warning", message=f"resumed at step {meta['step']} with {self.cfg.drafters} "
                          f"drafters x optim.accumulate {self.cfg.optim.accumulate}, the checkpoint's run "
                          f"had {then['drafters']} x {then.get('accumulate', 1)}: the run trains what its "
                          f"{self.cfg.optim.epochs} epochs have left, to step {total} (not "
                          f"{self.cfg.total_steps}), the schedule rebuilt over those steps")
            self.cfg = self.trainer.cfg = dataclasses.replace(self.cfg, resumed_total_steps=total)
            self.log.total_steps = total
        self.trainer.drafter.load_trainable_state_dict(model_state)
        self.trainer.load_state_dict(state["trainer"])
        self.order.load_state_dict(state["data"])
        if self.order.batches is None:  # saved before the count was: numbered as then (step x drafters)
            self.order.batches = self.trainer.step * self.cfg.drafters * self.cfg.optim.accumulate
        ranks = state["rng"]
        if isinstance(ranks, dict):  # written before the random state was kept per rank
            ranks = [{**ranks, "anchor": state["trainer"]["anchor_rng"]}]
        rank = self.drafters.rank
        own = ranks[rank] if rank < len(ranks) else None
        if own is not None:  # a rank the checkpoint's layout did not have keeps its fresh seed
            self.trainer.anchor_generator.set_state(own["anchor"])
            set_rng_state(own)
        self.last_saved_step = self.trainer.step
        changes = config_changes(self.cfg, checkpoint)  # [the checkpoint's value, this run's] by key
        self.log.emit("resume", step=self.trainer.step, checkpoint=str(checkpoint), saved_ranks=len(ranks),
                      changed={key: list(values) for key, values in changes.items()})
        if changes:
            self.log.emit("warning", message=f"resumed with keys changed since {checkpoint.name} was saved: "
                          f"{describe(changes)} (applied from this run's config)")

    def save(self, final: bool = False) -> None:
        """Every drafter rank takes part (its random state goes into the checkpoint); those that write
        the run's files copy the state to host memory and write it on a thread (DDP keeps every
        drafter's weights and optimizer the same). The previous save is settled first: at most one
        write is in flight. The `final` save (nothing trains after it) writes the state as it is, no copy,
        and the run waits for it (`settle_save`)."""
        self.settle_save()
        step = self.trainer.step
        states = self.drafters.gather(self.random_state())
        if self.drafters.writes_files:
            drafter = self.trainer.drafter
            meta = {"layer_ids": self.layer_ids, "drafter_config": dataclasses.asdict(drafter.cfg),
                    "target_path": self.cfg.model.target_path, "dtype": self.cfg.model.dtype,
                    "loss_weighting": self.cfg.loss_weighting, "step_plan": self.cfg.step_plan,
                    "enable_thinking": self.cfg.data.enable_thinking,
                    "enable_thinking_confirmed": self.thinking_confirmed,
                    "data_position": self.order.state_dict()}  # the batches taken: elastic resume's
            state = {"trainer": self.trainer.state_dict(), "data": self.order.state_dict(), "rng": states}
            # The only part the next step waits for: the copy to host memory.
            weights, state = ((drafter.trainable_state_dict(), state) if final
                              else self.writer.snapshot((drafter.trainable_state_dict(), state)))
            output_dir, config_yaml = self.output_dir, dump_config(self.cfg)
            keep = self.cfg.run.keep_checkpoints
            taus = dict(self.heldout_taus) if self.cfg.run.keep_best else None  # run.keep_best's

            def write() -> Path:
                spare = None if taus is None else best_step_to_keep(output_dir, step, taus)
                return save_checkpoint(output_dir, step, weights, state, config_yaml, meta, keep, spare)

            self.writer.start(step, write)
        self.unsettled_save = step

    def report_save(self, wait: bool) -> None:
        """The outcome of this rank's write in flight, logged once it has finished (at once with `wait`):
        `checkpoint`, or `checkpoint_failed` when the disk could not take it (the run goes on)."""
        if not self.writer.in_flight or not (wait or self.writer.done()):
            return
        step = self.writer.step
        try:
            path = self.writer.wait()
        except OSError as exc:  # a full disk: the run goes on, and says so
            last = latest_checkpoint(self.output_dir)
            self.log.emit("checkpoint_failed", step=step, message=(
                f"checkpoint step {step} could not be written in {self.output_dir}/checkpoints "
                f"({exc.strerror or exc}); nothing of it was kept, the last complete checkpoint is "
                f"{last.name if last else 'none'}; the next save tries again"))
            self.checkpoint_error = f"{exc.strerror or exc}"
            self.save_failed = True
        else:
            self.log.emit("checkpoint", step=step, path=str(path))
            self.checkpoint_error = None
            self.save_failed = False

    def settle_save(self) -> None:
        """Wait for the write of the last save, and agree with every drafter whether it was saved, so
        that all of them (or none) save again at the end (a collective: every drafter calls it)."""
        if self.unsettled_save is None:
            return
        self.report_save(wait=True)
        if not self.drafters.any(self.save_failed):
            self.last_saved_step = self.unsettled_save
        self.unsettled_save = None

    def evaluate_heldout(self) -> None:
        """Held-out loss and tau of the drafter now: logged and recorded."""
        started = time.perf_counter()
        fields = self.heldout(self.trainer.drafter).as_fields()
        seconds = round(time.perf_counter() - started, 3)
        self.log.emit("heldout", step=self.trainer.step, seconds=seconds, **fields)
        self.telemetry.record("heldout", self.trainer.step, {**fields, "seconds": seconds})
        if fields.get("heldout_tau") is not None:
            self.heldout_taus[self.trainer.step] = fields["heldout_tau"]

    def end_reason(self, steps_this_run: int) -> str | None:
        """Why the run ends before its next step, or None while it has steps to take."""
        if self.trainer.step >= self.cfg.total_steps:
            return "completed"
        budget = self.cfg.run.max_steps_per_run
        return "max_steps_per_run" if budget is not None and steps_this_run >= budget else None

    def run(self, source, stop) -> str:
        """Train until done, stopped, or the per-run step budget is spent; return why it ended. Each
        step's time runs from asking `source` for its batch to the end of the optimizer step."""
        # One line says where the step count comes from: epochs (null: optim.total_steps), examples,
        # batch_size, drafters, total_steps.
        plan = {**self.cfg.step_plan, "examples": len(self.examples)}
        counts = self.cfg.data_counts  # data.path's rows, those that train and those max_length cuts
        attention = self.trainer.attention
        self.log.emit("start", step=self.trainer.step, pid=os.getpid(), device=str(self.device),
                      target_layer_ids=self.layer_ids, **plan, **(counts.as_fields() if counts else {}),
                      attention=f"{attention.backend}{' compiled' if attention.compiled else ''}",
                      attention_reason=attention.reason, data_store=data_store(self.examples),
                      **({"overrides": list(self.cfg.overrides)} if self.cfg.overrides else {}))
        if counts is not None and counts.warning(self.cfg.data):
            self.log.emit("warning", message=counts.warning(self.cfg.data))
        try:
            reason = self.steps(source, stop)
        finally:  # a write in flight finishes before the run ends, however it ends
            self.report_save(wait=True)
        self.settle_save()
        if self.last_saved_step != self.trainer.step:
            self.save(final=True)
            self.settle_save()
        if self.last_saved_step != self.trainer.step and self.drafters.writes_files:
            self.log_lost_steps()
        self.telemetry.close()
        return reason

    def steps(self, source, stop) -> str:
        """The step loop of `run`: its steps, held-out evaluations and saves; why it ended."""
        run_cfg, total = self.cfg.run, self.cfg.total_steps
        steps_this_run, first_step, logged_batches = 0, {}, self.order.batches
        while (reason := self.end_reason(steps_this_run)) is None:
            started = time.perf_counter()
            batches = self.micro_batches(source, stop)
            # Waited for its batches: the target's features, the drafters' votes.
            waited = time.perf_counter() - started
            if batches is None:
                reason = source.stop_reason
                break
            result = self.drafters.mean(self.trainer.accumulated_step(batches))
            steps_this_run += 1
            seconds = time.perf_counter() - started
            if steps_this_run == 1:  # compilation included: said on the run's first step line
                first_step = {"first_step_seconds": round(seconds, 3)}
            samples = len(batches) * self.cfg.data.batch_size * self.cfg.drafters  # the global batch's rows
            self.meter.add(result, seconds, samples, waited)
            if result.step % run_cfg.log_every == 0 or result.step == total:
                # Means over the steps since the last line, not the last step's figures.
                figures = self.meter.flush()
                # The data order's batches these steps trained, [first, end) by index in the seeded order.
                trained, logged_batches = [logged_batches, self.order.batches], self.order.batches
                self.log.emit("step", step=result.step, lr=result.lr, blocks=result.num_blocks, **figures,
                              **first_step, batches=trained)
                first_step = {}
                self.telemetry.record("train", result.step, {**figures, "lr": result.lr})
            self.log.show_progress(result.step, result.loss, result.num_tokens / max(seconds, 1e-9),
                                   samples / max(seconds, 1e-9))
            if self.heldout is not None and (result.step % run_cfg.eval_every == 0 or result.step == total):
                self.evaluate_heldout()
            self.report_save(wait=False)
            if result.step % run_cfg.save_every == 0:
                self.save()
            stop.sleep(run_cfg.step_delay)
        return reason

    def micro_batches(self, source, stop) -> list[dict] | None:
        """The next step's optim.accumulate batches from `source`, or None when the run must stop: then
        the data order goes back to where the step began, so that a resume trains those batches."""
        position = self.order.state_dict()
        batches = []
        for _ in range(self.cfg.optim.accumulate):
            batch = source.next_batch(stop)
            if batch is None:
                if batches:
                    self.order.load_state_dict(position)
                return None
            batches.append(batch)
        return batches

    def log_lost_steps(self) -> None:
        """The run ends with steps its checkpoints do not hold (the final save failed): a `checkpoint_lost`
        line says which, and why; the run then exits non-zero and status.json says `failed`
        (dflash_ops.run.status), never `stopped` over steps that a resume would not find."""
        step, saved = self.trainer.step, self.last_saved_step
        last = latest_checkpoint(self.output_dir)
        kept = f"the last complete checkpoint is {last.name}" if last else "there is no complete checkpoint"
        first_lost = (saved or 0) + 1
        self.log.emit("checkpoint_lost", step=step, saved_step=saved, message=(
            f"the run trained to step {step} but its final checkpoint could not be written in "
            f"{self.output_dir}/checkpoints ({self.checkpoint_error or 'not saved'}); {kept}: steps "
            f"{first_lost}-{step} are not in any checkpoint (a resume trains them again once there is room)"))
