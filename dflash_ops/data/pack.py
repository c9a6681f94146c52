"""`python -m dflash_ops.data pack DATA.jsonl`: the token store of a training JSON-lines file, written beside
it (`DATA.jsonl.tokens/`, dflash_ops.core.token_store has the format and why)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from dflash_ops.core.token_store import MANIFEST, StoreWriter, source_identity, store_path
from dflash_ops.data.examples import DataError, iter_rows


def pack(data_path: str | Path, progress_every: int = 0, out=sys.stderr) -> Path:
    """Write the store of the JSON-lines file `data_path` beside it, from its rows as
    `dflash_ops.data.examples.iter_rows` reads and checks them (a DataError names a bad line)."""
    source = source_identity(data_path)
    writer = StoreWriter(store_path(data_path), source)
    try:
        for n, (ids, mask) in enumerate(iter_rows(data_path), start=1):
            writer.add(ids, mask)
            if progress_every and n % progress_every == 0:
                print(f"pack: {n:,} rows, {writer.tokens:,} tokens", file=out, flush=True)
        if source != source_identity(data_path):
            raise ValueError(f"{data_path} changed while it was packed: pack it again")
        return writer.finish()
    except BaseException:
        shutil.rmtree(writer.tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.data pack",
        description="Write the token store of a training JSON-lines file beside it (<DATA>.tokens/): every "
                    "rank then reads only its own rows in place, instead of parsing the whole file. "
                    "Pack again after the file changes (a stale store is not used).")
    parser.add_argument("data", help="the training JSON lines (data.path)")
    parser.add_argument("--progress-every", type=int, default=100_000, metavar="ROWS",
                        help="a progress line on stderr every ROWS rows (0: none; default %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = pack(args.data, progress_every=args.progress_every)
    except (DataError, ValueError, OSError) as exc:
        print(f"dflash_ops.data pack: {exc}", file=sys.stderr)
        return 2
    manifest = json.loads((path / MANIFEST).read_text())
    print(f"dflash_ops.data pack: {manifest['rows']:,} rows, {manifest['tokens']:,} tokens -> {path}")
    return 0
