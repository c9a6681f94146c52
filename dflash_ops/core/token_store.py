"""The training data as a token store: written once beside the JSON lines, read in place by every rank.

`python -m dflash_ops.data pack DATA.jsonl` writes `DATA.jsonl.tokens/` (dflash_ops.data.pack, through
`StoreWriter`):

- `input_ids.i32`: every row's tokens, one flat little-endian int32 array (a vocabulary up to 2^31);
- `loss_mask.u8`: the rows' loss masks, one flat uint8 array of the same length;
- `offsets.i64`: row r is `[offsets[r], offsets[r + 1])` of both (N + 1 int64);
- `loss_tokens.i32`: each whole row's count of loss tokens (data.min_loss_tokens needs no mask read
  except for a row data.max_length cuts);
- `manifest.json`: the format, the rows and tokens, the largest token id (the vocabulary check without
  a read), and the JSON-lines file's size and mtime the store was written from.

Why flat little-endian arrays rather than Arrow or `datasets`: numpy comes with torch (no dependency in
the container's venv), a row is two reads at offsets the index gives (no decode), and the kernel's page
cache holds one copy of a page for every rank on the machine. A rank reads only the rows of its own
batches (`TokenStore.row`), so its own memory is the index (20 bytes a row: offsets, loss counts and the
kept rows), not the data: at the recipe's 800K rows of ~1,500 tokens the JSON-parsed path costs ~19 GB a
rank (int64 tensors) where the store costs ~16 MB, and the ~6 GB of tokens and masks in the page cache
are shared.

`training_examples` (dflash_ops.data.examples, as `StoredExamples`) uses the store when it is fresh (its
manifest's size and mtime are the JSON-lines file's), and parses the JSON lines otherwise: the rows,
their truncation to data.max_length, the data.min_loss_tokens filter and their order are the same either
way. This module is the format alone (numpy, no torch): the config's example count reads it too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FORMAT = 1
SUFFIX = ".tokens"
FILES = {"input_ids": ("input_ids.i32", np.int32), "loss_mask": ("loss_mask.u8", np.uint8),
         "offsets": ("offsets.i64", np.int64), "loss_tokens": ("loss_tokens.i32", np.int32)}
MANIFEST = "manifest.json"
MAX_TOKEN_ID = 2**31 - 1


def store_path(data_path: str | Path) -> Path:
    """Where the store of the JSON-lines file `data_path` lives: `<data_path>.tokens`."""
    return Path(f"{data_path}{SUFFIX}")


def source_identity(data_path: str | Path) -> dict:
    stat = Path(data_path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class StoreWriter:
    """Appends rows to a store being written in a temporary directory; `finish` renames it into place, so
    a reader never sees half a store."""

    def __init__(self, path: str | Path, source: dict | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files = {name: (self.tmp / filename).open("wb") for name, (filename, _) in FILES.items()
                      if name != "offsets"}
        self.lengths: list[np.ndarray] = []
        self.rows = self.tokens = self.max_token_id = 0
        self.source = source

    def add(self, input_ids: Sequence[int], loss_mask: Sequence[int]) -> None:
        """One row (checked as the JSON lines are: dflash_ops.data.examples)."""
        ids, mask = np.asarray(input_ids, dtype=np.int64), np.asarray(loss_mask, dtype=np.int64)
        self.extend(ids, mask, np.array([ids.size], dtype=np.int64))

    def extend(self, input_ids: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """Many rows at once: their tokens and masks end to end, and each row's length."""
        if input_ids.size and (int(input_ids.min()) < 0 or int(input_ids.max()) > MAX_TOKEN_ID):
            raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
        if loss_mask.size and not np.isin(loss_mask, (0, 1)).all():
            raise ValueError("loss_mask must be 0/1")
        if int(lengths.sum()) != input_ids.size or input_ids.size != loss_mask.size or (lengths <= 0).any():
            raise ValueError("every row needs as many tokens as mask entries, and at least one")
        self.files["input_ids"].write(input_ids.astype("<i4").tobytes())
        self.files["loss_mask"].write(loss_mask.astype(np.uint8).tobytes())
        ends = np.cumsum(lengths)
        counts = np.add.reduceat(loss_mask.astype(np.int64), ends - lengths) if lengths.size else lengths
        self.files["loss_tokens"].write(counts.astype("<i4").tobytes())
        self.lengths.append(lengths.astype(np.int64))
        self.rows += lengths.size
        self.tokens += input_ids.size
        if input_ids.size:
            self.max_token_id = max(self.max_token_id, int(input_ids.max()))

    def finish(self) -> Path:
        for f in self.files.values():
            f.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        (self.tmp / FILES["offsets"][0]).write_bytes(offsets.tobytes())
        manifest = {"format": FORMAT, "rows": self.rows, "tokens": self.tokens,
                    "max_token_id": self.max_token_id, "source": self.source}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if self.path.exists():
            shutil.rmtree(self.path)
        os.replace(self.tmp, self.path)
        return self.path


class TokenStore:
    """A store's files: the index read whole (offsets, loss counts: 12 bytes a row), the rows read one at a
    time with pread(2), so that what a rank has read stays in the page cache (one copy for every rank on
    the machine) and never counts in the rank's own memory. (A memory map would do the same I/O but count
    every page touched, and the kernel's fault-around of 64 KB about each row, in the rank's RSS.)"""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = json.loads((self.path / MANIFEST).read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path}: token store format {self.manifest.get('format')}, "
                             f"expected {FORMAT}")
        self.offsets = self._index("offsets")
        if self.offsets.size != self.manifest["rows"] + 1 or self.offsets[-1] != self.manifest["tokens"]:
            raise ValueError(f"{self.path}: {self.offsets.size - 1} rows indexed, the manifest says "
                             f"{self.manifest['rows']}: write it again (python -m dflash_ops.data pack)")
        self.fds = {name: os.open(self.path / FILES[name][0], os.O_RDONLY)
                    for name in ("input_ids", "loss_mask")}

    def _index(self, name: str) -> np.ndarray:
        filename, dtype = FILES[name]
        return np.fromfile(self.path / filename, dtype=np.dtype(dtype).newbyteorder("<"))

    def __del__(self):
        for fd in getattr(self, "fds", {}).values():
            os.close(fd)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def _read(self, name: str, start: int, end: int) -> np.ndarray:
        dtype = np.dtype(FILES[name][1]).newbyteorder("<")
        data = os.pread(self.fds[name], (end - start) * dtype.itemsize, start * dtype.itemsize)
        if len(data) != (end - start) * dtype.itemsize:
            raise ValueError(f"{self.path}: {FILES[name][0]} is shorter than its index: write it again")
        return np.frombuffer(data, dtype=dtype)

    def row(self, r: int, max_length: int) -> tuple[np.ndarray, np.ndarray]:
        """Row `r`'s tokens and loss mask, its first `max_length` of them."""
        start = int(self.offsets[r])
        end = min(int(self.offsets[r + 1]), start + max_length)
        return self._read("input_ids", start, end), self._read("loss_mask", start, end)

    def kept_rows(self, max_length: int, min_loss_tokens: int | None) -> np.ndarray:
        """The rows `load_examples` keeps: all, or (with `min_loss_tokens`) those with that many loss
        tokens within `max_length`; a row max_length cuts has its mask's prefix counted."""
        if min_loss_tokens is None:
            return np.arange(len(self), dtype=np.int64)
        counts = self._index("loss_tokens").astype(np.int64)
        for r in np.flatnonzero(np.diff(self.offsets) > max_length):
            counts[r] = int(self.row(int(r), max_length)[1].sum(dtype=np.int64))
        return np.flatnonzero(counts >= min_loss_tokens).astype(np.int64)


def fresh_store(data_path: str | Path) -> TokenStore | None:
    """The store beside `data_path` when it was written from the file as it is now, else None."""
    path = store_path(data_path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("source") != source_identity(data_path):
            return None
        return TokenStore(path)
    except (OSError, ValueError):
        return None
