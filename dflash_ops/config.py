"""`python -m dflash_ops.config validate CONFIG [SECTION.KEY=VALUE ...]`: exit 0 when a training config is
good, 2 with the key and the message otherwise (the release role runs it in the container before it
switches releases).
`python -m dflash_ops.config reference` prints every key of the config, generated from its dataclasses.

The config itself (its dataclasses, `load_config`) is `dflash_ops.core.config`; this command sits above the
layers whose checks it runs: with the machine checks on, regenerated data's thinking mode is checked
against `data.enable_thinking` (`dflash_ops.data.data_manifest`) and a feature cache is checked too, shard by
shard (`dflash_ops.data.feature_cache`, imported only then: the check of a plain config stays light). Each
rank's predicted peak memory (`dflash_ops.training.memory_fit`) is checked against the memory of the GPUs it
gets: nvidia-smi's where it runs (a cuda layout with the machine checks on), or `--gpu-memory` offline.
A cuda layout with the machine checks on also needs a torch built for a CUDA version the driver runs
(`dflash_ops.core.cuda_build`: torch's CPU build or a newer CUDA major is refused, a newer minor is noted).
It prints what the run will cost, before anything is stopped: samples/s and GPU-hours of the whole run
(`dflash_ops.run.balance.RunCost`), modelled from the shapes and the one measured drafter step, or measured
(`--measured`: a run's balance line, a GPU check's drafter step).
A config that names an MLflow server (`run.mlflow_uri`, `run.report_to: [mlflow]`) needs MLflow's client in
this venv (`dflash_ops.training.mlflow_tracking.check_installed`), machine checks or not."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import typing

from dflash_ops.core import cuda_build
from dflash_ops.core.cli import add_config_arguments, parse_config_command
from dflash_ops.core.config import SECTIONS, ConfigError, TrainConfig, load_config
from dflash_ops.core.sections import type_name
from dflash_ops.data.data_manifest import check_thinking_mode
from dflash_ops.run import balance
from dflash_ops.training import memory_fit, mlflow_tracking

NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]


def check_features(cfg: TrainConfig) -> None:
    """The config's feature cache, if it names one, is this run's (its shards' checksums, unless
    features_verify is sizes)."""
    if cfg.data.features_path is not None:
        from dflash_ops.data.feature_cache import check_cache

        check_cache(cfg, checksums=cfg.data.features_verify == "checksums")


def gpu_memory(cfg: TrainConfig, offline: str | None, machine: bool) -> dict[int, int] | None:
    """{GPU index: bytes} of the GPUs the config gets: every GPU of the layout `offline` big (--gpu-memory),
    else nvidia-smi's figures for a cuda layout on this machine; None when there is nothing to check."""
    p = cfg.pipeline
    if offline is not None:
        size = memory_fit.parse_gpu_memory(offline)
        return {g: size for g in [*p.target_gpus, *p.drafter_gpus] or [0]}
    if not machine or p.device != "cuda" or shutil.which(NVIDIA_SMI_QUERY[0]) is None:
        return None
    try:
        done = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return memory_fit.parse_nvidia_smi(done.stdout)
        problem = f"exit {done.returncode}: {(done.stdout + done.stderr).strip()}"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        problem = str(exc)
    # nvidia-smi writes its errors (no driver, no devices) on stdout.
    raise ConfigError("pipeline", f"cannot read the GPUs' memory ({' '.join(NVIDIA_SMI_QUERY)}): {problem}")


def check_cuda_build(cfg: TrainConfig, machine: bool) -> str | None:
    """Refuse a cuda layout whose venv's torch cannot run on this machine's driver (ConfigError naming
    pipeline.device and the fix); what to note when it runs, None when nothing was checked (a cpu layout,
    the machine checks off, no nvidia-smi or no torch)."""
    if not machine or cfg.pipeline.device != "cuda" or shutil.which(cuda_build.NVIDIA_SMI_REPORT[0]) is None:
        return None
    try:
        report = cuda_build.read_report()
    except subprocess.CalledProcessError as exc:
        raise ConfigError("pipeline", f"cannot read the driver's CUDA version ({' '.join(exc.cmd)}): exit "
                                      f"{exc.returncode}: {(exc.stdout + exc.stderr).strip()}") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError("pipeline", f"cannot read the driver's CUDA version: {exc}") from None
    found = cuda_build.check(report, cuda_build.torch_build())
    if found is None:
        return None
    runs, message = found
    if not runs:
        raise ConfigError("pipeline.device", message)
    return message


class MemoryRefusal(ConfigError):
    """The predicted peaks do not fit the GPUs: `failing` lists every rank over its GPU
    (`memory_fit.failing_ranks`), which `--json` prints."""

    def __init__(self, key: str, message: str, failing: list[dict]):
        super().__init__(key, message)
        self.failing = failing


def check_memory(cfg: TrainConfig, gpus: dict[int, int] | None, terms: bool = False) -> str | None:
    """Refuse a config whose ranks' predicted peaks exceed their GPUs (ConfigError with the per-term
    figures and the knob to turn); the one-line summary when it fits (with `terms`, each rank's terms
    below it), None when nothing was checked."""
    if gpus is None:
        return None
    peaks = memory_fit.predict(cfg)
    by_role = memory_fit.gpu_memory_of(cfg, gpus)
    problem = memory_fit.refusal(peaks, by_role)
    if problem:
        key, message = problem
        raise MemoryRefusal(key, f"the predicted peak memory does not fit: {message}",
                            memory_fit.failing_ranks(peaks, by_role))
    return "\n".join([memory_fit.summary(peaks, by_role), *(p.table() for p in peaks if terms)])


def run_cost(cfg: TrainConfig, shape: memory_fit.TargetShape | None, measured: str | None
             ) -> balance.RunCost | None:
    """The run's samples/s and GPU-hours: from `measured` (a file with measured step times) when given, else
    modelled from the shapes (`balance.modelled_cost`, a cuda layout whose target shape was read); None
    when there is nothing to say it from or the run's length is not known (optim.epochs, data not counted)."""
    try:
        balance.run_samples(cfg)  # optim.epochs over data not counted (--no-target-check): no length
    except ConfigError:
        return None
    if measured is not None:
        try:
            return balance.measured_cost(cfg, measured, shape)
        except (OSError, ValueError) as exc:
            raise ConfigError("--measured", str(exc)) from None
    return None if shape is None else balance.modelled_cost(cfg, shape)


def reference() -> str:
    """Every key of the config, section by section, as YAML with each key's type (generated from the
    config's dataclasses; docs/CONTRACTS.md says what each one means)."""
    lines = ["# python -m dflash_ops.config reference: every key of a training config, its type and default",
             "# (required: no default); what each means: docs/CONTRACTS.md", ""]
    hints = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}
    for name, cls in SECTIONS.items():
        lines.append(f"{name}:")
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "required"
            shown = default if default == "required" else json.dumps(default)
            lines.append(f"  {f.name}: {shown}".ljust(40) + f"  # {type_name(hints[name][f.name])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_ops.config",
                                     description="Check a training config.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="exit 0 if the config is valid, else print why and exit 2")
    add_config_arguments(validate)
    validate.add_argument("--no-target-check", action="store_true",
                          help="skip the checks that need this machine: the target model, the data (and "
                               "its manifest's thinking mode) and the feature cache on disk, the GPUs of the "
                               "layout and the driver's CUDA version against torch's")
    validate.add_argument("--json", action="store_true",
                          help='print one JSON object on stdout: {"ok": true} or {"ok": false, "key": '
                               '"data.batch_size", "message": "expected int, got \'four\'"} (exit 2)')
    validate.add_argument("--gpu-memory", metavar="SIZE",
                          help="check each rank's predicted peak against GPUs of this size (141GiB, 80GB, "
                               "81559MiB; a bare number is GiB) instead of nvidia-smi's")
    validate.add_argument("--measured", metavar="FILE",
                          help="the run's cost from measured step times instead of the model: a run's "
                               "status.json or log (its balance line), or a GPU check's gpu_check.json")
    validate.add_argument("--memory-terms", action="store_true",
                          help="when the memory check runs and fits, print each rank's predicted peak term "
                               "by term")
    sub.add_parser("reference", help="print every key of the config: its section, type and default")
    args, _ = parser.parse_known_args(argv)
    if args.command == "reference":
        parser.parse_args(argv)
        print(reference(), end="")
        return 0
    args, config_path, overrides = parse_config_command(parser, argv)
    args.config = config_path
    try:
        cfg = load_config(config_path, check_target=not args.no_target_check, overrides=overrides)
        mlflow_tracking.check_installed(cfg.run)  # the venv that runs it, whatever --no-target-check says
        if not args.no_target_check:
            check_thinking_mode(cfg)
            check_features(cfg)
        cuda = check_cuda_build(cfg, machine=not args.no_target_check)
        fit = check_memory(cfg, gpu_memory(cfg, args.gpu_memory, machine=not args.no_target_check),
                           terms=args.memory_terms)
        shape = None if args.no_target_check else memory_fit.TargetShape.read(cfg.model.target_path)
        split = None if shape is None else balance.predicted_advice(cfg, shape)
        cost = run_cost(cfg, shape, args.measured)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "config": str(args.config), "key": exc.key, "message": exc.message,
                              **({"failing": exc.failing} if isinstance(exc, MemoryRefusal) else {})}))
        else:
            print(f"invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    counts = cfg.data_counts
    warning = counts.warning(cfg.data) if counts else None
    if args.json:
        print(json.dumps({"ok": True, "config": str(args.config),
                          **({"overrides": overrides} if overrides else {}),
                          **({"memory": fit} if fit else {}), **({"cuda": cuda} if cuda else {}),
                          **({"data": counts.as_fields()} if counts else {}),
                          **({"split": split.fields(*split.waits(), "FLOP")} if split else {}),
                          **({"cost": cost.fields()} if cost else {}),
                          **({"warning": warning} if warning else {})}))
    else:
        if warning:
            print(f"warning: {args.config}: {warning}", file=sys.stderr)
        line, _, terms = (fit or "").partition("\n")
        print(f"{args.config}: ok" + (f" ({line})" if line else "") + (f"\n{terms}" if terms else "")
              + (f"\n{cuda}" if cuda else "")
              + (f"\n{balance.predicted_line(split)}" if split else "")
              + (f"\n{cost.line(balance.run_plan(cfg))}" if cost else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
