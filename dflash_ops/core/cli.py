"""The command line of every command that reads a training config (`python -m dflash_ops.train`,
`python -m dflash_ops.config validate`, `python -m dflash_ops.capture`, a pipeline's workers): the config
first, then any SECTION.KEY=VALUE overrides, read and checked as the file's own keys are
(`dflash_ops.core.config.parse_overrides`):

    python -m dflash_ops.train configs/tiny-cpu.yaml optim.lr=1e-3 run.output_dir=runs/lr1e-3

`--config CONFIG`, the older spelling, still works (`--config CONFIG optim.lr=1e-3` too)."""

from __future__ import annotations

import argparse

CONFIG_HELP = "the YAML training config (its keys: python -m dflash_ops.config reference)"
OVERRIDES_HELP = ("keys of the config set for this call, after it (optim.lr=1e-3, data.eval_path=null, "
                  "model.target_layer_ids=[1,9,17]), typed and checked as the file's")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG (positional, or --config CONFIG) and the SECTION.KEY=VALUE overrides after it."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help=CONFIG_HELP)
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help=OVERRIDES_HELP)
    parser.add_argument("--config", dest="config_option", metavar="CONFIG",
                        help="the config, the older spelling of CONFIG")


def parse_config_command(parser: argparse.ArgumentParser, argv: list[str] | None
                         ) -> tuple[argparse.Namespace, str, list[str]]:
    """(the parsed options, the config's path, the overrides) of `argv`; argparse's usage error (exit 2)
    for an unknown option, no config or two."""
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    positional, option = args.config, args.config_option
    overrides = [*args.overrides, *extra]  # argparse takes those next to CONFIG, leaves those after an option
    if option is not None:
        if positional is not None and "=" not in positional:
            parser.error(f"the config is given twice: {positional} and --config {option}")
        if positional is not None:
            overrides.insert(0, positional)
        return args, option, overrides
    if positional is None or "=" in positional:
        parser.error("the config is required: CONFIG (or --config CONFIG) before any SECTION.KEY=VALUE")
    return args, positional, overrides
