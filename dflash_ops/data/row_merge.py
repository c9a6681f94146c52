"""Regeneration's merge in bounded memory: every row of the output and its parts, by id, to one file.

The parts hold the JSON lines each replica wrote (`{"id": N, "input_ids": [...], "loss_mask": [...]}`), at
the recipe's size ~800K rows of up to 3,072 tokens: 10-20 GB of text. Holding them as Python objects (the
merge before this one) took ~50-70 GB. This one reads each file once to index its complete lines (id, file,
offset, length: 28 bytes a row in arrays), sorts the index by id, and copies each line's bytes to the new
file in that order with `os.pread`: its memory grows with the row count, not the rows' length (200K rows
of 2K tokens: docs/PIPELINE.md), and no row is parsed beyond its id.

Which line counts: the complete ones (a line a kill cut short, the file's last, is skipped), and of two
lines with one id the later (a part's over the output's, a later line over an earlier one), as the
dict-based merge did.
"""

from __future__ import annotations

import json
import os
import re
from array import array
from pathlib import Path

# How regeneration writes a row's start: json.dumps of a dict whose first key is "id".
ROW_START = re.compile(rb'\{"id": (\d+),')


def _row_id(line: bytes) -> int | None:
    """The id of a complete row, None for a line that is not one (cut short, or not a row)."""
    match = ROW_START.match(line)
    if match and line.endswith(b"}\n"):
        return int(match.group(1))
    try:  # another spelling of a row: parse it whole
        row = json.loads(line)
        return int(row["id"]) if line.endswith(b"\n") else None
    except (ValueError, KeyError, TypeError):
        return None


def merge_rows(sources: list[Path], dest: Path) -> int:
    """Write the complete rows of `sources` (later sources and lines win an id) to `dest` by id, atomically
    (a temp file beside it, fsynced and renamed); returns the number of rows."""
    ids, files, offsets, lengths = array("q"), array("l"), array("q"), array("l")
    opened = []
    try:
        for number, path in enumerate(sources):
            if not path.is_file():
                opened.append(None)
                continue
            opened.append(os.open(path, os.O_RDONLY))
            offset = 0
            with path.open("rb") as f:
                for line in f:
                    row = _row_id(line)
                    if row is not None:
                        ids.append(row)
                        files.append(number)
                        offsets.append(offset)
                        lengths.append(len(line))
                    offset += len(line)
        # By id, and of one id the last indexed (sorted is stable): keep the last of each run of equal ids.
        order = sorted(range(len(ids)), key=ids.__getitem__)
        tmp = dest.with_name(f".{dest.name}.tmp")
        rows = 0
        with open(tmp, "wb") as out:
            for position, k in enumerate(order):
                if position + 1 < len(order) and ids[order[position + 1]] == ids[k]:
                    continue
                out.write(os.pread(opened[files[k]], lengths[k], offsets[k]))
                rows += 1
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(dest)
        return rows
    finally:
        for fd in opened:
            if fd is not None:
                os.close(fd)
