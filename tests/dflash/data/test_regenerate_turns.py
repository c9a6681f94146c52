"""`regenerate --turns all` (`dflash_ops.data.regenerate_turns`): every assistant turn of a multi-turn chat is
answered by the target in order, turn k's prompt holding the target's own earlier answers, and the row's
loss mask covers every answer; `--turns last` (the default) keeps today's rows; the vLLM engine refuses
`--turns all` by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.data_manifest import manifest_path
from dflash_ops.data.regenerate import GenerationSettings, ProvenanceError, regenerate
from tests.dflash.conftest import make_tiny_target
from tests.dflash.data.test_dataset_answers import expected_row
from tests.dflash.data.test_regenerate_thinking import QWEN3_LIKE, save_chat_tokenizer

SETTINGS = GenerationSettings(max_new_tokens=4, batch_size=2)  # greedy
CHAT = [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w4 w5"},
        {"role": "user", "content": "w6 w7"}, {"role": "assistant", "content": "w8"}]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("turns-target") / "target"
    make_tiny_target(path, vocab_size=27)  # the chat tokenizer's 27 ids: every answer decodes
    save_chat_tokenizer(path, QWEN3_LIKE)
    return str(path)


def write_chats(path: Path, chats: list) -> str:
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return str(path)


def only_row(out: Path) -> dict:
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    return rows[0]


def test_every_turn_is_answered_in_order_and_scored(chat_target, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_target)
    # Independently, turn by turn with --turns last: the first answer, then the second one to the chat
    # holding the first.
    first = tmp_path / "first.jsonl"
    regenerate(chat_target, write_chats(tmp_path / "p1.jsonl", [CHAT[:1]]), str(first), SETTINGS)
    row = only_row(first)
    answer = tokenizer.decode(row["input_ids"][row["loss_mask"].index(1):], skip_special_tokens=True)
    assert answer.strip(), "the tiny target's first answer is empty: pick another chat"
    second_chat = [CHAT[0], {"role": "assistant", "content": answer}, CHAT[2]]
    second = tmp_path / "second.jsonl"
    regenerate(chat_target, write_chats(tmp_path / "p2.jsonl", [second_chat]), str(second), SETTINGS)
    expected = only_row(second)

    out = tmp_path / "all.jsonl"
    summary = regenerate(chat_target, write_chats(tmp_path / "chat.jsonl", [CHAT]), str(out), SETTINGS,
                         max_length=64, turns="all")
    assert summary["turns"] == 2 and summary["rows"] == 1
    row = only_row(out)
    assert row["input_ids"] == expected["input_ids"]  # the dataset's answers gave way to the target's
    # The mask: the first answer with its <|im_end|> (as the template writes it), then the second answer.
    ids, mask = expected_row(tokenizer, second_chat[:2])
    assert row["input_ids"][: len(ids)] == ids
    prompt_length = expected["loss_mask"].index(1)
    answer_mask = expected["loss_mask"][prompt_length:]
    assert row["loss_mask"] == mask + [0] * (prompt_length - len(mask)) + answer_mask
    assert sum(mask) >= 2
    assert json.loads(manifest_path(out).read_text())["generation"]["turns"] == "all"

    # --turns last (the default) keeps the dataset's first answer, unscored, and its manifest says so.
    last = tmp_path / "last.jsonl"
    regenerate(chat_target, str(tmp_path / "chat.jsonl"), str(last), SETTINGS, max_length=64)
    row = only_row(last)
    ids, _ = expected_row(tokenizer, CHAT[:2])
    assert row["input_ids"][: len(ids)] == ids and 1 not in row["loss_mask"][: len(ids)]
    assert json.loads(manifest_path(last).read_text())["generation"]["turns"] == "last"
    # A resume under the other choice would mix rows: refused, as any other setting.
    (tmp_path / "last.jsonl.part-0").write_text(json.dumps(row) + "\n")
    with pytest.raises(ProvenanceError, match="turns 'last' -> 'all'"):
        regenerate(chat_target, str(tmp_path / "chat.jsonl"), str(last), SETTINGS, max_length=64, turns="all")


def test_a_turn_over_the_max_length_skips_the_chat_and_the_engine_refuses_all_turns(chat_target, tmp_path,
                                                                                      capsys):
    long_second = CHAT[:2] + [{"role": "user", "content": " ".join(["w9"] * 30)}]
    prompts = write_chats(tmp_path / "chats.jsonl", [CHAT, long_second])
    out = tmp_path / "all.jsonl"
    summary = regenerate(chat_target, prompts, str(out), SETTINGS, max_length=32, turns="all")
    assert summary["rows"] == 1 and summary["skipped_too_long"] == 1
    assert only_row(out)["id"] == 0
    assert data_main(["regenerate", "--target", chat_target, "--prompts", prompts, "--out",
                      str(tmp_path / "engine.jsonl"), "--engine", "hf", "--engine-python", "python3",
                      "--turns", "all"]) == 2
    err = capsys.readouterr().err
    assert "--turns all answers each turn after the one before it" in err and "Traceback" not in err
