"""The token store (dflash_ops.core.token_store, dflash_ops.data.pack): the same rows as the JSON lines, in
the same order, under every truncation and filter; used only while it is fresh; written whole or not at all;
and read in place, so that a rank's memory does not grow with the data set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from dflash_ops.core.config import count_examples
from dflash_ops.core.token_store import StoreWriter, fresh_store, store_path
from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.examples import DataError, load_examples, training_examples
from dflash_ops.data.pack import pack
from dflash_ops.run.main import main as train_main
from tests.dflash.conftest import write_dataset

REPO = Path(__file__).resolve().parents[3]


def write_rows(path: Path) -> Path:
    """Rows of varied length and loss, with blank lines between some."""
    rng = np.random.default_rng(0)
    lines = []
    for index in range(40):
        length = int(rng.integers(1, 70))
        mask = (rng.random(length) < 0.6).astype(int).tolist()
        lines.append(json.dumps({"input_ids": [index] + rng.integers(0, 120, length - 1).tolist(),
                                 "loss_mask": mask}))
        if index % 7 == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("max_length,min_loss_tokens",
                         [(64, None), (16, None), (16, 8), (48, 20), (2, 2), (64, 60)])
def test_the_store_holds_the_json_lines_rows_truncated_and_filtered_alike(tmp_path, max_length,
                                                                          min_loss_tokens):
    data = write_rows(tmp_path / "train.jsonl")
    pack(data)
    store = fresh_store(data)
    assert store is not None and len(store) == 40
    data_cfg = SimpleNamespace(path=str(data), max_length=max_length, min_loss_tokens=min_loss_tokens)
    try:
        parsed = load_examples(data, max_length, 120, min_loss_tokens)
    except DataError as exc:
        with pytest.raises(DataError, match="holds no examples"):
            training_examples(data_cfg, 120)
        assert "holds no examples" in str(exc)
        return
    stored = training_examples(data_cfg, 120)
    assert type(stored).__name__ == "StoredExamples" and len(stored) == len(parsed)
    assert count_examples(data, max_length, min_loss_tokens) == len(parsed)
    for a, b in zip(parsed, stored, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert b.input_ids.dtype == torch.int64


def test_a_stale_store_is_not_used_and_an_out_of_vocabulary_row_is_named(tmp_path):
    data = write_rows(tmp_path / "train.jsonl")
    pack(data)
    with data.open("a") as f:  # the file changed after its store was written
        f.write(json.dumps({"input_ids": [7, 125], "loss_mask": [0, 1]}) + "\n")
    assert fresh_store(data) is None
    data_cfg = SimpleNamespace(path=str(data), max_length=64, min_loss_tokens=None)
    assert type(training_examples(data_cfg)) is list and count_examples(data, 64) == 41

    pack(data)
    assert len(training_examples(data_cfg)) == 41
    with pytest.raises(DataError, match=r"row 41\): token id 125 is outside the target's vocabulary \(120\)"):
        training_examples(data_cfg, 120)
    data_cfg = SimpleNamespace(path=str(data), max_length=2, min_loss_tokens=None)
    with data.open("a") as f:  # an id outside the vocabulary beyond max_length is not read, as today
        f.write(json.dumps({"input_ids": [7, 8, 126], "loss_mask": [0, 1, 1]}) + "\n")
    pack(data)
    with pytest.raises(DataError, match=r"row 41\): token id 125"):
        training_examples(data_cfg, 120)


def test_a_bad_line_leaves_no_store_and_says_where(tmp_path, capsys):
    data = write_rows(tmp_path / "train.jsonl")
    with data.open("a") as f:
        f.write('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    assert data_main(["pack", str(data)]) == 2
    assert "train.jsonl:47: input_ids and loss_mask must be non-empty lists of equal length" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]  # no store, no temporary left


def test_a_run_on_the_store_trains_on_the_same_rows_in_the_same_order_and_resumes_at_the_same_row(
        tiny_config, tmp_path, capsys):
    data = write_dataset(tmp_path / "train.jsonl", n_rows=24, max_len=60)  # rows longer than max_length 48

    def losses(name: str, **run) -> list[float]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(tiny_config(tmp_path / name, data={"path": str(data)},
                                                     optim={"total_steps": 6}, run={"log_every": 1, **run})))
        out = ""
        for _ in range(2 if run else 1):
            assert train_main([str(config)]) == 0
            out += capsys.readouterr().out
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        starts = [r for r in records if r["event"] == "start"]
        assert all(r["data_store"] == (str(store_path(data)) if fresh_store(data) else None) for r in starts)
        return [r["loss"] for r in records if r["event"] == "step"]

    parsed = losses("parsed")
    assert data_main(["pack", str(data)]) == 0 and "24 rows" in capsys.readouterr().out
    assert losses("stored", max_steps_per_run=3, save_every=3) == parsed


def test_a_ranks_memory_stays_flat_over_a_million_rows(tmp_path):
    """1M rows of 100 to 156 tokens (128M tokens): parsed into int64 tensors they take ~3.5 GB a rank
    (measured: 3.5 KB a row of 128 tokens, 2 x 8 bytes a token and ~1.4 KB of objects); a rank that reads
    the rows of its 400 batches of 64 from the store grows by the index alone."""
    rows, rng = 1_000_000, np.random.default_rng(0)
    lengths = rng.integers(100, 157, rows)
    writer = StoreWriter(tmp_path / "big.tokens")
    for chunk in np.array_split(lengths, 10):
        tokens = int(chunk.sum())
        writer.extend(rng.integers(0, 151936, tokens), (rng.random(tokens) < 0.7).astype(np.int64), chunk)
    writer.finish()
    probe = f"""
import json, resource, sys
import numpy as np, torch
from dflash_ops.data.examples import BatchOrder, collate
from dflash_ops.core.token_store import TokenStore
from dflash_ops.data.examples import StoredExamples

def rss_mb():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {{k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}}

torch.zeros(1)
before = rss_mb()
examples = StoredExamples(TokenStore({str(tmp_path / "big.tokens")!r}), max_length=3072, min_loss_tokens=16)
order = BatchOrder(len(examples), 64, seed=0)
rank, ranks, seen = 1, 5, 0
for i in range(400 * ranks):  # a target rank of 5 computes every 5th batch (dflash_ops.run.pipeline)
    indices = order.next_batch()
    if i % ranks == rank:
        seen += int(collate([examples[j] for j in indices])["attention_mask"].sum())
after = rss_mb()
print(json.dumps({{"rows": len(examples), "tokens_read": seen, "before": before, "after": after}}))
"""
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["rows"] == rows and figures["tokens_read"] > 400 * 64 * 100
    growth = {key: figures["after"][key] - figures["before"][key] for key in figures["before"]}
    print(f"rank memory growth (MB): {growth}")
    assert growth["VmRSS"] < 200 and growth["RssAnon"] < 200, figures
