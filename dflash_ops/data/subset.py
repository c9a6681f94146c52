"""A subset of a data set's rows, for a feature cache of practical size (`python -m dflash_ops.capture
--rows A:B` or `--fraction F`).

At the recipe's shape a cached token costs ~41 KB (5 layers x 4096 features in bf16), 50-100 TB for the
whole 800K-row set; a subset is what a cache can hold. The capture writes the chosen rows, as they are in
data.path (its non-blank lines, in order), to `data.jsonl` in the cache directory and captures that file:
a run that reads the cache names it as its data.path, so every count, order and check that a run makes of
its data holds for the subset unchanged, and the cache's plan says which rows of which file it holds.

- `--rows A:B`: rows A to B - 1, counted from 0 (`A:` to the end, `:B` from the start);
- `--fraction F`: F of the rows, evenly spread over the file (row j * n // k for j < k = floor(n x F)), so
  that a file written in prompt order (regeneration's) is sampled across its sources, not cut at one.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflash_ops.core.config import ConfigError
from dflash_ops.data.feature_cache import SUBSET_FILE, file_sha256


def parse_rows(text: str) -> tuple[int | None, int | None]:
    """'A:B', 'A:' or ':B' -> (A, B), either None when open."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(start) if start.strip() else None, int(end) if end.strip() else None)
    except ValueError:
        raise ConfigError("--rows", f"expected A:B (rows A to B - 1, from 0; A: or :B), got {text!r}") \
            from None
    if any(b is not None and b < 0 for b in bounds):
        raise ConfigError("--rows", f"rows count from 0, got {text!r}")
    return bounds


def count_rows(path: str | Path) -> int:
    """The file's rows: its non-blank lines."""
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def chosen_rows(total: int, rows: tuple[int | None, int | None] | None,
                fraction: float | None) -> range | list:
    """The indices of the rows a subset keeps, of a file of `total` rows."""
    if rows is not None:
        start, end = rows[0] or 0, total if rows[1] is None else rows[1]
        if not start < end <= total:
            raise ConfigError("--rows", f"{start}:{end} is not a range of the file's {total} rows")
        return range(start, end)
    if fraction is None or not 0 < fraction <= 1:
        raise ConfigError("--fraction", f"expected a fraction of the rows in (0, 1], got {fraction}")
    keep = int(total * fraction)
    if keep == 0:
        raise ConfigError("--fraction", f"{fraction} of {total} rows keeps none")
    return [j * total // keep for j in range(keep)]


def write_subset(source: str | Path, out_dir: str | Path, rows: tuple[int | None, int | None] | None,
                 fraction: float | None) -> dict:
    """Write the chosen rows of `source` to `out_dir`/data.jsonl (atomically; kept when it holds them
    already) and return what the cache's plan says of them."""
    total = count_rows(source)
    chosen = chosen_rows(total, rows, fraction)
    keep = chosen if isinstance(chosen, range) else set(chosen)
    dest = Path(out_dir) / SUBSET_FILE
    tmp = dest.with_name(f".{SUBSET_FILE}.tmp")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(tmp, "wb") as out:
        index = 0
        for line in src:
            if not line.strip():
                continue
            if index in keep:
                out.write(line if line.endswith(b"\n") else line + b"\n")
            index += 1
        out.flush()
        os.fsync(out.fileno())
    if dest.is_file():
        same = file_sha256(dest) == file_sha256(tmp)
        tmp.unlink()
        if not same:  # never replace the data of a capture under way
            raise ConfigError("--out", f"{dest} holds other rows than these: finish that capture with its "
                              "own --rows or --fraction, or capture elsewhere")
    else:
        tmp.replace(dest)
    selection = ({"rows": [chosen.start, chosen.stop]} if isinstance(chosen, range)
                 else {"fraction": fraction})
    return {"of": str(source), "of_sha256": file_sha256(source), "of_rows": total, "kept": len(chosen),
            **selection}
