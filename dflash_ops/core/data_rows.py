"""The training rows' checks and their words, in one place: the loader (`dflash_ops.data.examples`) and the
config's check of data.path (`dflash_ops.core.config.survey_data`, which `validate`, `train --dry-run` and
`train` itself run before anything starts) both call these functions, so a row the trainer would refuse is
refused by `validate` with the same message.

A row of data.path is one JSON line `{"input_ids": [...], "loss_mask": [...]}` (docs/CONTRACTS.md). A chat
(ShareGPT/SpecForge `conversations`, OpenAI-style `messages`) is a prompt, not a training row: it is
refused with the command that turns prompts into rows. No torch here (this is the base layer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROW_FORMAT = '{"input_ids": [...], "loss_mask": [...]}'
CHAT_KEYS = ("conversations", "messages")


class DataError(ValueError):
    """The data file is missing or a line of it is malformed. `key` names the config key when the message
    does not already say which file (a line's message names its file and line)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(f"{key}: {message}" if key else message)
        self.key, self.message = key, message


def data_file(path: str | Path) -> Path:
    """`path`, once it is known to be a file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no data file at {path}", key="data.path")
    return path


def text_lines(path: Path):
    """(line number, line) of every non-blank line of the text file at `path`; a file that is not UTF-8
    text (a parquet or Arrow file given as JSON lines) is refused, naming the line."""
    line_no = 0
    with path.open(encoding="utf-8") as f:
        try:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield line_no, line
        except UnicodeDecodeError:
            raise DataError(f"{path}:{line_no + 1}: not UTF-8 text; a training file is JSON lines "
                            f"{ROW_FORMAT} (a parquet or Arrow file is a prompt set: python -m "
                            "dflash_ops.data regenerate --prompts)") from None


def parse_row(line: str, where: str) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one JSON line, checked; `where` (file:line) begins any refusal."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not JSON ({exc.msg})") from exc
    if isinstance(row, dict) and any(key in row for key in CHAT_KEYS) and "input_ids" not in row:
        raise DataError(f"{where}: a chat ({' or '.join(k for k in CHAT_KEYS if k in row)}), not a training "
                        f"row {ROW_FORMAT}: turn prompts into rows with python -m dflash_ops.data regenerate "
                        "--target DIR --prompts FILE --out TRAIN.jsonl (docs/CONTRACTS.md)")
    if not isinstance(row, dict) or "input_ids" not in row or "loss_mask" not in row:
        raise DataError(f"{where}: expected an object with input_ids and loss_mask")
    ids, mask = row["input_ids"], row["loss_mask"]
    if not (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask) and ids):
        raise DataError(f"{where}: input_ids and loss_mask must be non-empty lists of equal length")
    if not all(isinstance(t, int) and t >= 0 for t in ids) or not _binary(mask):
        raise DataError(f"{where}: input_ids must be non-negative ints and loss_mask 0/1")
    return ids, mask


def _binary(mask: list) -> bool:
    """Every entry of `mask` is 0 or 1 (a set: four times faster than a loop over a long row)."""
    try:
        return set(mask) <= {0, 1}
    except TypeError:  # an unhashable entry (a list) is neither
        return False


def check_vocabulary(largest: int, vocab_size: int | None, where: str) -> None:
    """Refuse a row (its kept tokens' largest id `largest`) with an id the target cannot embed."""
    if vocab_size is not None and largest >= vocab_size:
        raise DataError(f"{where}: token id {largest} is outside the target's vocabulary ({vocab_size})")


def no_examples(path, min_loss_tokens: int | None, dropped: int) -> DataError:
    """The refusal of a data file that leaves no example (empty, or every row under data.min_loss_tokens)."""
    short = f" with {min_loss_tokens} loss tokens or more (data.min_loss_tokens; {dropped} fewer)" \
        if dropped else ""
    return DataError(f"{path} holds no examples{short}", key="data.path")


def checked_rows(path: str | Path, max_length: int, vocab_size: int | None) -> int:
    """The rows of the JSON-lines file at `path` (a held-out set), each checked as the loader checks it."""
    path, rows = data_file(path), 0
    for line_no, line in text_lines(path):
        ids, _ = parse_row(line, f"{path}:{line_no}")
        check_vocabulary(max(ids[:max_length]), vocab_size, f"{path}:{line_no}")
        rows += 1
    if not rows:
        raise no_examples(path, None, 0)
    return rows


def check_store(path, store, max_length: int, vocab_size: int | None, min_loss_tokens: int | None
                ) -> np.ndarray:
    """The rows of a token store (`dflash_ops.core.token_store`) the loader keeps, once none holds an id
    beyond the vocabulary (the manifest's largest id first: a store within it is not read) and one is
    kept at all."""
    rows = store.kept_rows(max_length, min_loss_tokens)
    if vocab_size is not None and store.manifest["max_token_id"] >= vocab_size:
        for i, r in enumerate(rows):  # the store's largest id may lie beyond max_length: find a kept one
            largest = int(store.row(int(r), max_length)[0].max())
            check_vocabulary(largest, vocab_size, f"{path} (its token store, row {int(rows[i]) + 1})")
    if not rows.size:
        raise no_examples(path, min_loss_tokens, len(store))
    return rows


STORE_CHUNK_TOKENS = 1 << 24  # the loss masks read at once by `store_counts` (16 MB, and 64 MB of sums)


def store_counts(store, max_length: int, block_size: int, min_loss_tokens: int | None
                 ) -> tuple[int, int, int, int]:
    """(rows, rows that form a block, rows max_length cuts, rows data.min_loss_tokens drops) of a token
    store, as `dflash_ops.core.config.survey_data` counts the JSON lines (a kept row forms a block when it
    has an anchor a <= min(length, max_length) - block_size with loss_mask[a] = loss_mask[a + 1] = 1), from
    its index and its loss masks read a chunk of rows at a time (numpy, no row parsed)."""
    offsets = store.offsets.astype(np.int64)
    lengths = np.diff(offsets)
    kept = np.zeros(len(store), dtype=bool)
    kept[store.kept_rows(max_length, min_loss_tokens)] = True
    forms = np.zeros(len(store), dtype=bool)
    first = 0
    while first < len(store):
        last = int(np.searchsorted(offsets, offsets[first] + STORE_CHUNK_TOKENS, side="right")) - 1
        last = min(max(last, first + 1), len(store))
        base = int(offsets[first])
        mask = store._read("loss_mask", base, int(offsets[last])).astype(bool)
        pairs = np.concatenate([[0], np.cumsum(mask[:-1] & mask[1:], dtype=np.int64)])
        starts = offsets[first:last] - base
        ends = starts + np.minimum(lengths[first:last], max_length) - block_size + 1  # past the last anchor
        ends_in = np.clip(ends, starts, pairs.size - 1)
        forms[first:last] = (ends > starts) & (pairs[ends_in] > pairs[starts])
        first = last
    return len(store), int((forms & kept).sum()), int((lengths > max_length).sum()), int((~kept).sum())
