"""`python -m dflash_ops.data COMMAND ...`: the data commands (`regenerate`, `tokenize`, `pack`)."""

from __future__ import annotations

import sys

COMMANDS = {"regenerate": "answer a prompt set with the target: the training JSON lines (see --help)",
            "tokenize": "a chat dataset's own answers as the training JSON lines (see --help)",
            "pack": "write the training JSON lines' token store, which ranks read in place (see --help)"}


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ops.data COMMAND ...`; COMMAND's own `--help` tells its options."""
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m dflash_ops.data COMMAND [options]\n\ncommands:\n" + "".join(
        f"  {name:<12} {help_text}\n" for name, help_text in COMMANDS.items())
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stdout if argv else sys.stderr, end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"{usage}\nerror: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    if argv[0] == "pack":
        from dflash_ops.data.pack import main as pack_main

        return pack_main(argv[1:])
    if argv[0] == "tokenize":
        from dflash_ops.data.dataset_answers import main as tokenize_main

        return tokenize_main(argv[1:])
    from dflash_ops.data.regenerate import main as regenerate_main

    return regenerate_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
