"""`dflash-ops COMMAND ...` (the console script) and `python -m dflash_ops COMMAND ...`: one entry point for
the commands a user types. Each command is also its own module (`python -m dflash_ops.train ...`), which is
what the releases' `run.sh` and the roles call; both spellings run the same `main`."""

from __future__ import annotations

import importlib
import sys

# command -> (the module whose main() runs it, what it does)
COMMANDS = {
    "train": ("dflash_ops.run.main", "train a drafter: one process, or the pipeline through torchrun"),
    "config": ("dflash_ops.config", "check a training config (validate), list its keys (reference)"),
    "capture": ("dflash_ops.capture", "write the target's hidden states once, as a feature cache"),
    "data": ("dflash_ops.data.__main__", "the data commands: regenerate, pack"),
    "evaluate": ("dflash_ops.serve.evaluate", "a drafter's acceptance length against its target"),
    "export": ("dflash_ops.serve.export", "a checkpoint as a drafter the engines load"),
    "plots": ("dflash_ops.training.plots", "the run's curves from its metrics.jsonl, as PNG files"),
    "demo": ("dflash_ops.data.demo", "the demo's tiny target, tokenizer and data"),
}


def usage() -> str:
    return ("usage: dflash-ops COMMAND [options]   (or python -m dflash_ops COMMAND)\n\ncommands:\n"
            + "".join(f"  {name:<10} {text}\n" for name, (_, text) in COMMANDS.items())
            + "\nCOMMAND --help tells its options.\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr, end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{usage()}\nerror: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return getattr(module, "cli", module.main)(argv[1:])  # `cli`: a command that owns its process's signals


if __name__ == "__main__":
    sys.exit(main())
