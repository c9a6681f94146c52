"""Training data: JSON lines of `{"input_ids": [...], "loss_mask": [...]}`, a resumable batch
order, and collation to a right-padded batch for the target.

`python -m dflash_ops.data regenerate ...` builds such a file from a prompt set
(`dflash_ops.data.regenerate`); `python -m dflash_ops.data pack ...` writes its token store, which every rank
then memory-maps (`dflash_ops.data.pack`, `dflash_ops.core.token_store`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash_ops.core.data_rows import (  # noqa: F401 (DataError: this module's API too)
    DataError,
    check_store,
    check_vocabulary,
    data_file,
    no_examples,
    parse_row,
    text_lines,
)
from dflash_ops.core.token_store import TokenStore, fresh_store


@dataclass
class Example:
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] int64, 1 on response tokens


def iter_rows(path: str | Path):
    """(input_ids, loss_mask) of every non-blank line of the JSON-lines file at `path`, whole and checked
    (a DataError names the line)."""
    path = data_file(path)
    for line_no, line in text_lines(path):
        yield parse_row(line, f"{path}:{line_no}")


def load_examples(path: str | Path, max_length: int, vocab_size: int | None = None,
                  min_loss_tokens: int | None = None) -> list[Example]:
    """Every line of the JSON-lines file at `path`, truncated to `max_length` tokens; with
    `min_loss_tokens`, less the examples that keep fewer loss tokens than that (SpecForge's filter,
    counted after the truncation as SpecForge counts them)."""
    path = data_file(path)
    examples, dropped = [], 0
    for line_no, line in text_lines(path):
        ids, mask = parse_row(line, f"{path}:{line_no}")
        example = Example(torch.tensor(ids[:max_length], dtype=torch.int64),
                          torch.tensor(mask[:max_length], dtype=torch.int64))
        check_vocabulary(int(example.input_ids.max()), vocab_size, f"{path}:{line_no}")
        if min_loss_tokens is not None and int(example.loss_mask.sum()) < min_loss_tokens:
            dropped += 1
            continue
        examples.append(example)
    if not examples:
        raise no_examples(path, min_loss_tokens, dropped)
    return examples


class StoredExamples(Sequence):
    """The examples of a token store as `load_examples` returns them (same rows, truncation, filter and
    order), each read from the store when a batch asks for it."""

    def __init__(self, store: TokenStore, max_length: int, min_loss_tokens: int | None = None, rows=None):
        self.store, self.max_length = store, max_length
        self.rows = store.kept_rows(max_length, min_loss_tokens) if rows is None else rows

    def __len__(self) -> int:
        return self.rows.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids, mask = self.store.row(int(self.rows[i]), self.max_length)
        return Example(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64)))


def stored_examples(path: str | Path, store, max_length: int, vocab_size: int | None = None,
                    min_loss_tokens: int | None = None) -> Sequence[Example]:
    """`load_examples` of `path` read from its token store (dflash_ops.core.token_store): the same rows in the
    same order, each read from the mapping when a batch asks for it."""
    return StoredExamples(store, max_length, rows=check_store(path, store, max_length, vocab_size,
                                                              min_loss_tokens))


def training_examples(data, vocab_size: int | None = None) -> Sequence[Example]:
    """The training examples a config's `data` section names: those of data.path with its max_length and
    min_loss_tokens, memory-mapped from its token store when a fresh one lies beside it
    (`python -m dflash_ops.data pack`), parsed from the JSON lines otherwise."""
    store = fresh_store(data_file(data.path))
    if store is not None:
        return stored_examples(data.path, store, data.max_length, vocab_size, data.min_loss_tokens)
    return load_examples(data.path, data.max_length, vocab_size, data.min_loss_tokens)


class BatchOrder:
    """Which examples form each batch: a fresh seeded permutation per epoch, read in order.

    The state is (epoch, cursor) and `batches`, the batches taken since the run began (batch i of the
    seeded order is the i-th taken, whatever the number of workers that took them): a resumed run
    continues with exactly the next batch, and a pipeline numbers it `batches` (dflash_ops.run.pipeline).
    A checkpoint from before `batches` was recorded leaves it None: the resume numbers batches as it
    did then (step x drafters)."""

    def __init__(self, num_examples: int, batch_size: int, seed: int):
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.epoch, self.cursor = 0, 0
        self.batches: int | None = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        indices = []
        while len(indices) < self.batch_size:
            if self.cursor == self.num_examples:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(self.batch_size - len(indices), self.num_examples - self.cursor)
            indices += self._order[self.cursor: self.cursor + take]
            self.cursor += take
        if self.batches is not None:
            self.batches += 1
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_examples": self.num_examples,
                "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != self.num_examples:
            raise DataError(f"the checkpoint was written for {state['num_examples']} examples, the data "
                            f"now has {self.num_examples} (data.path's, less any data.min_loss_tokens drops)")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.batches = state.get("batches")
        self._order = self._permutation(self.epoch)


def collate(examples: list[Example], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `loss_mask`, each `[B, Lmax]`."""
    max_len = max(e.input_ids.numel() for e in examples)
    batch = {name: torch.zeros(len(examples), max_len, dtype=torch.int64)
             for name in ("input_ids", "attention_mask", "loss_mask")}
    batch["input_ids"].fill_(pad_token_id)
    for row, e in enumerate(examples):
        n = e.input_ids.numel()
        batch["input_ids"][row, :n] = e.input_ids
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, :n] = e.loss_mask
    return batch
