"""`python -m dflash_ops.data tokenize` (`dflash_ops.data.dataset_answers`): a chat dataset's own answers as
training rows, without regenerating them: the target's chat template, the loss mask over every assistant
turn and nothing else, rows over the max length skipped and counted, a manifest the trainer checks, and a
file `dflash_ops.train` trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.data_manifest import manifest_path
from dflash_ops.run.main import main as train_main
from tests.dflash.conftest import make_tiny_target
from tests.dflash.data.test_regenerate_thinking import QWEN3_LIKE, save_chat_tokenizer

TWO_TURNS = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2 w3"},
             {"role": "assistant", "content": "w4 w5"}, {"role": "user", "content": "w6"},
             {"role": "assistant", "content": "w7 w8 w10"}, {"role": "user", "content": "w11"}]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("answers-target") / "target"
    make_tiny_target(path)
    save_chat_tokenizer(path, QWEN3_LIKE)
    return str(path)


def expected_row(tokenizer, chat: list[dict]) -> tuple[list[int], list[int]]:
    """The row of `chat` built turn by turn from QWEN3_LIKE's text for one message,
    `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`: 1 on an assistant's CONTENT and its <|im_end|>."""
    ids, mask = [], []
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for message in chat:
        scored = int(message["role"] == "assistant")
        role = tokenizer.encode(message["role"], add_special_tokens=False)
        content = tokenizer.encode(message["content"], add_special_tokens=False)
        ids += [start] + role + content + [end]
        mask += [0] * (1 + len(role)) + [scored] * len(content) + [scored]
    return ids, mask


def write_chats(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_mask_covers_every_assistant_turn_and_nothing_else(chat_target, tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_target)
    long_chat = [{"role": "user", "content": " ".join(["w1"] * 40)}, {"role": "assistant", "content": "w2"}]
    sharegpt = {"conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w12 w13"}]}
    chats = write_chats(tmp_path / "chats.jsonl", [
        {"messages": TWO_TURNS}, [{"role": "user", "content": "w1"}], {"messages": long_chat}, sharegpt])
    out = tmp_path / "train.jsonl"
    assert data_main(["tokenize", "--target", chat_target, "--chats", chats, "--out", str(out),
                      "--max-length", "32"]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"] == 2 and summary["skipped_too_long"] == 1 and summary["skipped_no_answer"] == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == [0, 3]
    # The two-turn chat, its last user message dropped: both answers scored, with their ends.
    ids, mask = expected_row(tokenizer, TWO_TURNS[:-1])
    assert rows[0]["input_ids"] == ids and rows[0]["loss_mask"] == mask
    assert sum(mask) == 2 + 1 + 3 + 1
    ids, mask = expected_row(tokenizer, [{"role": "user", "content": "w3"},
                                         {"role": "assistant", "content": "w12 w13"}])
    assert rows[1]["input_ids"] == ids and rows[1]["loss_mask"] == mask
    record = json.loads(manifest_path(out).read_text())
    assert record["answers"] == "dataset" and record["enable_thinking"] is False and record["rows"] == 2
    assert record["tokenize"]["max_length"] == 32 and record["tokenize"]["skipped_too_long"] == 1


def test_the_trainer_trains_on_the_tokenized_file(chat_target, tmp_path, capsys):
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}] * 8)
    out = tmp_path / "train.jsonl"
    assert data_main(["tokenize", "--target", chat_target, "--chats", chats, "--out", str(out)]) == 0
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"target_path": chat_target, "block_size": 2},
        "data": {"path": str(out), "max_length": 48, "batch_size": 4},
        "optim": {"total_steps": 2}, "run": {"output_dir": str(tmp_path / "run")}}))
    capsys.readouterr()
    assert train_main(["--config", str(config)]) == 0, capsys.readouterr().err
    # A thinking-mode config is refused against the manifest's mode.
    config.write_text(config.read_text().replace("batch_size: 4", "batch_size: 4\n  enable_thinking: true"))
    assert train_main(["--config", str(config), "--fresh"]) == 2
    assert "data.enable_thinking: the config says true" in capsys.readouterr().err


def test_a_thinking_mode_the_template_lacks_and_unreadable_chats_are_refused(chat_target, tmp_path, capsys):
    plain = tmp_path / "plain"
    make_tiny_target(plain)
    save_chat_tokenizer(plain, "{% for message in messages %}{{ message['content'] }} {% endfor %}")
    chats = write_chats(tmp_path / "chats.jsonl", [{"messages": TWO_TURNS}])
    assert data_main(["tokenize", "--target", str(plain), "--chats", chats, "--out",
                      str(tmp_path / "o.jsonl"), "--enable-thinking", "true"]) == 2
    assert "no enable_thinking toggle" in capsys.readouterr().err
    bad = write_chats(tmp_path / "bad.jsonl", [{"text": "w1"}])
    assert data_main(["tokenize", "--target", chat_target, "--chats", bad, "--out",
                      str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "accepted prompt sets" in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()
