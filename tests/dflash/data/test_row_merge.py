"""Regeneration's merge (`dflash_ops.data.row_merge`): the rows of the output and its parts, by id, the later
of two with one id, a line cut short skipped, in memory that does not grow with the rows' length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_ops.data.regenerate import merge

REPO = Path(__file__).resolve().parents[3]


def row(i: int, tokens: list[int]) -> str:
    return json.dumps({"id": i, "input_ids": tokens, "loss_mask": [1] * len(tokens)}) + "\n"


def test_the_merge_writes_each_id_once_in_order_the_later_row_winning(tmp_path):
    out = tmp_path / "train.jsonl"
    out.write_text(row(0, [1]) + row(2, [2]))  # an earlier merge's rows
    part0, part1 = out.with_name("train.jsonl.part-0"), out.with_name("train.jsonl.part-1")
    part0.write_text(row(5, [5]) + row(2, [22]) + row(3, [3]) + row(2, [222]) + row(7, [7])[:-9])  # cut short
    part1.write_text(row(4, [4]) + "not a row\n" + json.dumps({"input_ids": [1]}) + "\n"
                     + json.dumps({"loss_mask": [1], "id": 1, "input_ids": [11]}) + "\n")  # another key order
    assert merge(out, 2) == 6
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[2]["input_ids"] == [222] and rows[1]["input_ids"] == [11]  # the later line, the part's
    assert not part0.exists() and not part1.exists() and not list(tmp_path.glob(".*tmp"))


def test_the_merge_s_memory_does_not_grow_with_the_rows_length(tmp_path):
    """Rows of 2K tokens in two parts, ids out of order: the merge process's peak resident memory grows by a
    small fraction of the data (the dict-based merge held all of it as Python objects, several times its
    size). DFLASH_MERGE_ROWS=200000 runs the issue's size (3.5 GB of rows) by hand."""
    rows = int(os.environ.get("DFLASH_MERGE_ROWS", "20000"))
    tokens = ", ".join(str(t % 151936) for t in range(0, 2048 * 7919, 7919))  # 2K ids, as json.dumps
    mask = ", ".join(["1"] * 2048)
    out = tmp_path / "train.jsonl"
    for replica in (0, 1):
        with open(out.with_name(f"train.jsonl.part-{replica}"), "w") as part:
            for i in reversed(range(replica, rows, 2)):
                part.write(f'{{"id": {i}, "input_ids": [{tokens}], "loss_mask": [{mask}]}}\n')
    data = sum(p.stat().st_size for p in tmp_path.glob("train.jsonl.part-*"))
    script = ("import sys\nfrom dflash_ops.data.regenerate import merge\n"
              "def status(field):\n"
              "    lines = open('/proc/self/status')\n"
              "    return next(int(x.split()[1]) for x in lines if x.startswith(field)) * 1024\n"
              "open('/proc/self/clear_refs', 'w').write('5')\nbefore = status('VmRSS:')\n"
              "count = merge(sys.argv[1], 2)\nprint(count, status('VmHWM:') - before)\n")
    done = subprocess.run([sys.executable, "-c", script, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    count, growth = map(int, done.stdout.split())
    assert count == rows and out.stat().st_size == data
    print(f"merge of {rows} rows of 2K tokens ({data / 2**20:.0f} MiB): peak RSS growth "
          f"{growth / 2**20:.1f} MiB")
    assert growth < max(64 << 20, data // 20), (growth, data)
    with out.open() as merged:  # in id order, every one
        previous = -1
        for line in merged:
            current = int(line[7:line.index(",")])
            assert current == previous + 1
            previous = current
