"""`python -m dflash.config validate <yaml>`: exit 0 when a training config is good, 2 with the key and
the message otherwise (the release role runs it in the container before it switches releases).

The config itself (its dataclasses, `load_config`) is `dflash.core.config`; this command sits above the
layers whose checks it runs: with the machine checks on, regenerated data's thinking mode is checked
against `data.enable_thinking` (`dflash.data.data_manifest`) and a feature cache is checked too, shard by
shard (`dflash.data.feature_cache`, imported only then: the check of a plain config stays light)."""

from __future__ import annotations

import argparse
import json
import sys

from dflash.core.config import ConfigError, TrainConfig, load_config
from dflash.data.data_manifest import check_thinking_mode


def check_features(cfg: TrainConfig) -> None:
    """The config's feature cache, if it names one, is this run's (its shards' checksums, unless
    features_verify is sizes)."""
    if cfg.data.features_path is not None:
        from dflash.data.feature_cache import check_cache

        check_cache(cfg, checksums=cfg.data.features_verify == "checksums")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.config", description="Check a training config.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="exit 0 if the config is valid, else print why and exit 2")
    validate.add_argument("config", help="path to the YAML training config")
    validate.add_argument("--no-target-check", action="store_true",
                          help="skip the checks that need this machine: the target model, the data (and "
                               "its manifest's thinking mode) and the feature cache on disk, the GPUs of the "
                               "layout")
    validate.add_argument("--json", action="store_true",
                          help='print one JSON object on stdout: {"ok": true} or {"ok": false, "key": '
                               '"data.batch_size", "message": "expected int, got \'four\'"} (exit 2)')
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, check_target=not args.no_target_check)
        if not args.no_target_check:
            check_thinking_mode(cfg)
            check_features(cfg)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "config": str(args.config), "key": exc.key,
                              "message": exc.message}))
        else:
            print(f"invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"ok": True, "config": str(args.config)}) if args.json else f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
