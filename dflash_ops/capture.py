"""`python -m dflash_ops.capture CONFIG [SECTION.KEY=VALUE ...] [--out DIR]`: capture the target's features
of a training config's data set into a feature cache (the work is `dflash_ops.data.capture`; this module
parses the command line, checks it and maps failures to exit codes)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from dflash_ops.core.cli import add_config_arguments, parse_config_command
from dflash_ops.core.config import ConfigError, check_against_target, load_config
from dflash_ops.core.runtime import EventLog, StopSignal, exit_code_of
from dflash_ops.data.capture import DEFAULT_SHARD_MB, FREE_BYTES_ENV, CaptureError, capture
from dflash_ops.data.examples import DataError
from dflash_ops.data.subset import SUBSET_FILE, parse_rows, write_subset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.capture",
        description="Capture the target's features of a training config's data set into a feature cache "
                    "that runs read with data.features_path. Resumable by shard; SIGTERM stops at a shard "
                    "boundary.")
    add_config_arguments(parser)
    parser.add_argument("--out", help="the cache directory (default: the config's data.features_path)")
    parser.add_argument("--replicas", type=int,
                        help="target replicas (default: every visible GPU on cuda, 1 on cpu)")
    subset = parser.add_mutually_exclusive_group()
    subset.add_argument("--rows", metavar="A:B",
                        help="cache rows A to B - 1 of data.path (from 0; A: or :B): they are written to "
                             "OUT/data.jsonl, the data.path of a run that reads the cache")
    subset.add_argument("--fraction", type=float, metavar="F",
                        help="cache F of data.path's rows, evenly spread over the file (0 < F <= 1), "
                             "written to OUT/data.jsonl as --rows")
    parser.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_MB,
                        help=f"shard size in MiB, whole batches (default {DEFAULT_SHARD_MB}); a stop waits "
                             "for each replica's shard at hand")
    args, config_path, overrides = parse_config_command(parser, argv)
    log, stop = EventLog(0), StopSignal().install()

    def run_capture() -> None:
        cfg = load_config(config_path, check_target=False, overrides=overrides)
        check_against_target(cfg)
        out = args.out or cfg.data.features_path
        if not out:
            raise CaptureError("name the cache directory: --out DIR, or data.features_path in the config")
        cuda = cfg.pipeline.device == "cuda"
        replicas = args.replicas or (torch.cuda.device_count() if cuda else 1)
        visible = torch.cuda.device_count() if cuda else None
        if replicas < 1 or (cuda and replicas > visible):
            raise CaptureError(f"--replicas {replicas}: must be 1..{visible} (the visible GPUs)" if cuda
                               else "--replicas must be >= 1")
        if args.shard_mb < 1:
            raise CaptureError("--shard-mb must be >= 1")
        free = int(os.environ[FREE_BYTES_ENV]) if FREE_BYTES_ENV in os.environ else None
        chosen = None
        if args.rows is not None or args.fraction is not None:
            if os.path.exists(out) and not os.path.isdir(out):
                raise CaptureError(f"{out} is not a directory")
            rows = parse_rows(args.rows) if args.rows is not None else None
            chosen = write_subset(cfg.data.path, out, rows, args.fraction)
            log.emit("subset", path=os.path.join(out, SUBSET_FILE), **chosen)
        capture(cfg, out, replicas, args.shard_mb << 20, free, log, stop, subset=chosen)

    return exit_code_of(run_capture, log, stop, (CaptureError, ConfigError, DataError, FileNotFoundError),
                        "dflash_ops.capture")


if __name__ == "__main__":
    sys.exit(main())
