"""The prompt sets the field brings (`dflash_ops.data.chat_formats`): ShareGPT's and SpecForge's
`conversations` (both spellings, both role sets), OpenAI-style `messages`, and local parquet or Arrow
files and directories (through pyarrow, when the venv has it) are read as the same chats, and regenerate
the same rows; anything else is refused once, naming the accepted formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.chat_formats import ACCEPTED, PromptError
from dflash_ops.data.chat_prompts import read_chats
from tests.dflash.conftest import make_tiny_target
from tests.dflash.data.test_regenerate_thinking import QWEN3_LIKE, save_chat_tokenizer

MESSAGES = [
    [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2 w3"},
     {"role": "assistant", "content": "w4 w5"}],
    [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w5 w6"},
     {"role": "user", "content": "w7 w8"}],
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(chat):
    return {"conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in chat]}


def specforge(chat):
    return {"id": "x", "conversations": [{"role": m["role"], "content": m["content"]} for m in chat]}


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


EXPECTED = [MESSAGES[0][:-1], MESSAGES[1]]  # a trailing assistant turn is the answer regenerated


@pytest.mark.parametrize("spelling", [sharegpt, specforge, lambda chat: {"messages": chat},
                                      lambda chat: chat])
def test_every_spelling_of_a_chat_reads_as_the_same_messages(spelling, tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [spelling(chat) for chat in MESSAGES])
    assert read_chats(path) == EXPECTED


def test_both_spellings_mix_in_one_file_and_blank_lines_keep_the_ids(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(sharegpt(MESSAGES[0])) + "\n\n" + json.dumps(specforge(MESSAGES[1])) + "\n")
    assert read_chats(path) == [EXPECTED[0], [], EXPECTED[1]]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat-target") / "target"
    make_tiny_target(path)
    save_chat_tokenizer(path, QWEN3_LIKE)
    return str(path)


def test_sharegpt_prompts_regenerate_the_rows_of_the_same_messages(chat_target, tmp_path, capsys):
    made = {}
    for name, spelling in (("messages", lambda chat: {"messages": chat}), ("sharegpt", sharegpt)):
        prompts = write_jsonl(tmp_path / f"{name}.jsonl", [spelling(chat) for chat in MESSAGES])
        out = tmp_path / f"{name}-train.jsonl"
        assert data_main(["regenerate", "--target", chat_target, "--prompts", prompts, "--out", str(out),
                          "--engine", "hf", "--max-new-tokens", "3", "--max-length", "64"]) == 0, \
            capsys.readouterr().err
        made[name] = [{k: row[k] for k in ("id", "input_ids", "loss_mask")}
                      for row in map(json.loads, out.read_text().splitlines())]
    assert len(made["sharegpt"]) == 2 and made["sharegpt"] == made["messages"]


ROBOT = [{"conversations": [{"from": "robot", "value": "a"}]}]
REFUSED = {
    "another row shape": lambda p: write_jsonl(p / "p.jsonl", [{"text": "w1 w2"}]),
    "an unknown role": lambda p: write_jsonl(p / "p.jsonl", ROBOT),
    "a turn without text": lambda p: write_jsonl(p / "p.jsonl", [{"conversations": [{"from": "human"}]}]),
    "a JSON array file": lambda p: (p / "p.json").write_text(json.dumps([{"messages": MESSAGES[0]}],
                                                                        indent=1)) and str(p / "p.json"),
    "binary": lambda p: (p / "p.bin").write_bytes(bytes(range(128, 256))) and str(p / "p.bin"),
    "an empty directory": lambda p: (p / "d").mkdir() or str(p / "d"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_anything_else_is_refused_once_naming_the_accepted_formats(case, chat_target, tmp_path, capsys):
    path = REFUSED[case](tmp_path)
    with pytest.raises(PromptError) as refused:
        read_chats(path)
    assert str(refused.value).startswith(str(path)) and str(refused.value).endswith(ACCEPTED)
    assert data_main(["regenerate", "--target", chat_target, "--prompts", path, "--out",
                      str(tmp_path / "out.jsonl"), "--engine", "hf"]) == 2
    err = capsys.readouterr().err
    assert ACCEPTED in err and "Traceback" not in err


def write_tables(root: Path, pa, pq) -> dict[str, str]:
    """The same prompts as a parquet file, an Arrow stream (datasets' shard format), an Arrow IPC file,
    and a save_to_disk-like directory of two shards."""
    rows = [sharegpt(MESSAGES[0]), specforge(MESSAGES[1])]
    table = pa.Table.from_pylist([{"conversations": [{"from": t.get("from"), "value": t.get("value"),
                                                      "role": t.get("role"), "content": t.get("content")}
                                                     for t in row["conversations"]]} for row in rows])
    pq.write_table(table, root / "p.parquet")
    with pa.OSFile(str(root / "p.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pa.OSFile(str(root / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    shards = root / "saved"
    shards.mkdir()
    for i in range(2):
        with pa.OSFile(str(shards / f"data-{i:05d}-of-00002.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i, 1))
    (shards / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"} for i in range(2)]}))
    return {"parquet": str(root / "p.parquet"), "arrow stream": str(root / "p.arrow"),
            "arrow file": str(root / "file.arrow"), "save_to_disk": str(shards)}


def test_parquet_and_arrow_prompt_sets_read_as_the_same_chats(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc  # noqa: F401
    import pyarrow.parquet as pq

    for name, path in write_tables(tmp_path, pa, pq).items():
        assert read_chats(path) == EXPECTED, name


def test_a_parquet_prompt_set_without_pyarrow_is_refused_naming_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as in a venv without it
    path = tmp_path / "train-00000-of-00001.parquet"
    path.write_bytes(b"PAR1" + bytes(32) + b"PAR1")
    with pytest.raises(PromptError, match="read through pyarrow, which this venv lacks") as refused:
        read_chats(path)
    assert str(refused.value).endswith(ACCEPTED)
    with pytest.raises(PromptError, match="pip install pyarrow"):
        read_chats(tmp_path)  # a directory of them too
