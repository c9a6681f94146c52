"""Entry point: `python -m dflash_ops.train CONFIG [SECTION.KEY=VALUE ...] [--dry-run] [--fresh]` (`--config
CONFIG` too: `dflash_ops.core.cli`).

A config whose `pipeline` section names workers runs as a pipeline: this process becomes its
launcher (dflash_ops.run.launcher). Otherwise the run is this one process: the frozen target and the
drafter live here and take turns each step (the drafter side is dflash_ops.training.drafter_run's
`DrafterRun`, fed by `TargetFeatures`). SIGTERM (or SIGINT) lets the current step finish, then the run saves a
checkpoint, logs a `stop` event (status.json: `stopped`) and exits 0: the stop takes at most one
step plus one checkpoint save (a `run.step_delay` pause is cut short), which is what a stop timeout
must allow for. Run as the process's command (`cli`), a stop at any other moment exits 0 too: before the
run (while the config loads) nothing starts; in its last seconds (the final save, the exit) the run's
checkpoint is written and the stop changes nothing. Exit codes: 0 done or stopped, 1 crashed or its
final checkpoint could not be written (a `checkpoint_lost` line, status.json `failed`: the steps since the
last checkpoint are in none), 2 bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from dflash_ops.core.cli import add_config_arguments, parse_config_command
from dflash_ops.core.compile_cache import compile_cache_environment
from dflash_ops.core.config import ConfigError, TrainConfig, load_config
from dflash_ops.core.loss_section import capture_layer_ids
from dflash_ops.core.runtime import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_OK, StopSignal, exit_code_of
from dflash_ops.core.safe_paths import UnsafePath
from dflash_ops.data.data_manifest import check_thinking_mode
from dflash_ops.data.examples import DataError
from dflash_ops.data.target import TargetHead, load_target, step_features
from dflash_ops.run.cache_feed import cached_run
from dflash_ops.run.effective import effective_config
from dflash_ops.run.metrics import RunMetrics
from dflash_ops.run.run_lock import RunLock, RunLocked
from dflash_ops.run.status import RunStatus, StatusLog
from dflash_ops.training.checkpoint import check_fresh_start, move_run_aside
from dflash_ops.training.drafter_run import DrafterRun
from dflash_ops.training.resume_check import check_resume, describe

WORKER = "trainer"  # the single process's name in status.json's workers


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("pipeline.device", "'cuda' requested but no CUDA device is visible")
    return torch.device("cuda" if name == "cuda" else "cpu")


class TargetFeatures:
    """The single process's batch source: its own target computes each step's features, from the
    next batch of the run's data order, unless a stop was requested."""

    def __init__(self, target, run: DrafterRun):
        self.target, self.run = target, run
        self.stop_reason = ""

    def next_batch(self, stop: StopSignal) -> dict | None:
        if stop.requested:
            self.stop_reason = f"signal {stop.signal_name}"
            return None
        run = self.run
        # loss.kind other than ce: the target's last layer too (its last hidden state, for the loss).
        layer_ids = capture_layer_ids(run.layer_ids, self.target.config.num_hidden_layers, run.cfg.loss.mix)
        return step_features(self.target, [run.examples[i] for i in run.order.next_batch()], layer_ids,
                             run.cfg.model.target_rows_per_pass, run.device)

    def close(self) -> None:
        pass


def run_single_process(cfg: TrainConfig, stop: StopSignal | None = None) -> int:
    """Run the whole training in this process; return the exit code. `stop`: the process's own (`cli`), whose
    handler then outlives the run; else one installed for the run's time."""
    torch.set_num_threads(cfg.pipeline.threads_per_worker)
    status = RunStatus(cfg.run.output_dir, process_worker=WORKER, metrics=RunMetrics.of(cfg.run))
    log = StatusLog(0, status)  # DrafterRun sets the steps
    stop = (stop or StopSignal()).install()

    def train() -> None:
        device = resolve_device(cfg.pipeline.device)
        # torch.compile's cache kept across restarts and releases (dflash_ops.core.compile_cache).
        os.environ.update(compile_cache_environment(cfg.run.output_dir, os.environ, device.type == "cuda"))
        if cfg.data.features_path is not None:  # the target's features come from a feature cache
            run, source = cached_run(cfg, log, device)
        else:
            target = load_target(cfg.model.target_path, cfg.model.dtype, device)
            run = DrafterRun(cfg, log, TargetHead.of(target))
            if cfg.data.eval_path is not None:
                run.build_heldout(target)
            run.resume()
            source = TargetFeatures(target, run)
        try:
            reason = run.run(source, stop)
        finally:
            source.close()
        log.emit("stop", step=run.trainer.step, reason=reason,
                 **({"signalled_at": round(stop.signalled_at, 3)} if stop.signalled_at else {}))

    code = exit_code_of(train, log, stop, (ConfigError, DataError, FileNotFoundError, UnsafePath),
                        "dflash_ops.train")
    if code == EXIT_OK and log.status.lost is not None:  # trained steps no checkpoint holds
        print(f"dflash_ops.train: {log.status.lost}", file=sys.stderr)
        return EXIT_CRASH
    return code


HELP_EPILOG = """\
config sections (every key, its type and default: python -m dflash_ops.config reference; their meaning:
docs/CONTRACTS.md):
  model     the frozen target (target_path), the drafter's shape (num_draft_layers, block_size,
            target_layer_ids, mask_token_id, layer_types), dtype and memory knobs
  data      the training JSON lines (path, max_length, batch_size, max_anchors, min_loss_tokens), the
            held-out set (eval_path, eval_examples), a feature cache (features_path), enable_thinking
  optim     lr, weight_decay, warmup_ratio, max_grad_norm, total_steps or epochs, the loss weighting
  run       output_dir, save_every, keep_checkpoints, log_every, eval_every, seed, resume
  pipeline  device, and the pipeline's layout: target and drafter workers or GPUs, members
  loss      what the block positions train against: kind ce, kl, tvd or mix, and the mix's weights

examples:
  python -m dflash_ops.train configs/tiny-cpu.yaml --dry-run
  python -m dflash_ops.train configs/tiny-cpu.yaml optim.lr=1e-3 run.output_dir=runs/lr1e-3
  python -m dflash_ops.train configs/tiny-cpu.yaml run.resume=false --fresh

exit codes: 0 done or stopped (SIGTERM: checkpoint, then exit), 1 crashed or the final checkpoint could
not be written (a full disk: the steps since the last checkpoint are lost), 2 bad input."""


def main(argv: list[str] | None = None, stop: StopSignal | None = None) -> int:
    """The command; `stop`, when given, is the process's stop signal (`cli`)."""
    parser = argparse.ArgumentParser(prog="python -m dflash_ops.train",
                                     description="Train a DFlash drafter for a frozen target model.",
                                     epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, resolve it and print the effective config (with the target "
                             "layers, mask token, steps and warm-up, the data's counts, the checkpoint a "
                             "resume takes); start nothing, write nothing")
    parser.add_argument("--fresh", action="store_true",
                        help="start a new run in run.output_dir: the run already there (checkpoints, "
                             "status.json, logs) is moved aside to <output_dir>.previous-<UTC time>, never "
                             "deleted")
    args, config_path, overrides = parse_config_command(parser, argv)
    lock = None
    try:
        cfg = load_config(config_path, overrides=overrides)
        check_thinking_mode(cfg)  # before any process or model starts
        if args.dry_run:
            resuming = None if args.fresh else (check_fresh_start(cfg.run.output_dir, cfg.run.resume)
                                                or check_resume(cfg))
            print(effective_config(cfg, resuming), end="")
            return 0
        if args.fresh:
            lock = RunLock(cfg.run.output_dir)  # before the run there is moved aside
            aside = move_run_aside(cfg.run.output_dir)
            if aside is not None:
                print(f"dflash_ops.train: --fresh: the run in {cfg.run.output_dir} moved to {aside}",
                      file=sys.stderr)
                lock, moved = RunLock(cfg.run.output_dir), lock  # the new directory's own
                moved.release()
        else:
            # One writer: held until this process (and a pipeline's torchrun) ends. A directory that is
            # there may hold a live run: its lock is asked for first, so a second trainer is refused
            # at once; a new one is made only once the config is known to start.
            if Path(cfg.run.output_dir).is_dir():
                lock = RunLock(cfg.run.output_dir)
            check_fresh_start(cfg.run.output_dir, cfg.run.resume)
            resuming = check_resume(cfg)  # before anything is loaded or written
            lock = lock or RunLock(cfg.run.output_dir)
            if resuming is not None and resuming[1]:
                print(f"dflash_ops.train: warning: resuming {resuming[0]} with keys changed since it was "
                      f"saved, applied from this config: {describe(resuming[1])}", file=sys.stderr)
    except (ConfigError, UnsafePath) as exc:
        if lock is not None:
            lock.release()
        print(f"invalid config {config_path}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunLocked as exc:
        if lock is not None:
            lock.release()
        print(f"dflash_ops.train: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BaseException:
        if lock is not None:  # an in-process caller may start again
            lock.release()
        raise
    with lock:
        if stop is not None and stop.requested:  # before anything was trained: nothing to save
            print(f"dflash_ops.train: {stop.signal_name} before the run began: nothing started",
                  file=sys.stderr)
            return EXIT_OK
        if cfg.pipeline.is_multi_process:
            from dflash_ops.run.launcher import launch

            return launch(cfg, config_path, lock.fd)
        return run_single_process(cfg, stop)


def cli(argv: list[str] | None = None) -> int:
    """`main` as the process's command: SIGTERM and SIGINT are the run's stop request from the process's
    start to its exit. A stop while the config loads is a stop before the run (exit 0, nothing started);
    one in the run's last seconds (its final save, the lock's release, the interpreter's exit) finds the
    run's checkpoint written and changes nothing (exit 0), where the default action would end it 143."""
    return main(argv, StopSignal().install())


if __name__ == "__main__":
    sys.exit(cli())
