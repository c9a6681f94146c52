"""Regenerated training data: the chat template, the target's own greedy answers, the loss mask on
the answers, resuming after a stop, several replicas, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from dflash_ops.data.__main__ import main as data_main
from dflash_ops.data.data_manifest import FORMAT
from dflash_ops.data.examples import load_examples
from dflash_ops.data.regenerate import GenerationSettings, parts_record_path, regenerate
from dflash_ops.data.target import load_target

SETTINGS = GenerationSettings(max_new_tokens=12, batch_size=2)


@pytest.fixture
def prompts(demo_dir, tmp_path):
    """Five demo chats of different lengths; the second ends with an assistant turn to replace."""
    chats = [json.loads(line) for line in (demo_dir / "data" / "prompts.jsonl").read_text().splitlines()[:5]]
    for i, chat in enumerate(chats):
        chat["messages"][0]["content"] = chat["messages"][0]["content"][: 40 + 15 * i]
    chats[1]["messages"].append({"role": "assistant", "content": "an old answer"})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path, chats


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_the_chat_template_then_the_targets_greedy_answer(demo_dir, prompts, tmp_path):
    path, chats = prompts
    out = tmp_path / "train.jsonl"
    summary = regenerate(str(demo_dir / "target"), str(path), str(out), SETTINGS)
    assert summary["generated"] == 5 and summary["rows"] == 5
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "target")
    target = load_target(demo_dir / "target")
    written = rows(out)
    assert [r["id"] for r in written] == [0, 1, 2, 3, 4]
    for row, chat in zip(written, chats, strict=True):
        messages = [m for m in chat["messages"] if m["role"] != "assistant"]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        n = len(prompt)
        assert row["input_ids"][:n] == prompt
        assert row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        ids = torch.tensor([prompt])
        greedy = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=SETTINGS.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
        assert row["input_ids"][n:] == greedy[0, n:].tolist()  # batched, left-padded: the same answer
    assert len(load_examples(out, max_length=512)) == 5  # what the trainer reads


def test_a_second_call_skips_the_rows_done_before_a_stop(demo_dir, prompts, tmp_path):
    path, _ = prompts
    out = tmp_path / "train.jsonl"
    # What a stop leaves: the call's record (the demo template has no thinking toggle: mode null), a part
    # file with two finished rows and a line cut short.
    parts_record_path(out).write_text(json.dumps({"format": FORMAT, "enable_thinking": None}))
    done = [{"id": i, "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]} for i in (0, 3)]
    (tmp_path / "train.jsonl.part-0").write_text("".join(json.dumps(r) + "\n" for r in done)
                                                 + '{"id": 1, "input_ids": [5,')
    summary = regenerate(str(demo_dir / "target"), str(path), str(out), SETTINGS)
    assert summary["generated"] == 3 and summary["rows"] == 5
    written = rows(out)
    assert [r["id"] for r in written] == [0, 1, 2, 3, 4]
    assert written[0] == done[0] and written[3] == done[1]  # kept, not answered again
    assert len(written[1]["input_ids"]) > 3
    assert not list(tmp_path.glob("train.jsonl.part-*")) and not parts_record_path(out).exists()
    again = regenerate(str(demo_dir / "target"), str(path), str(out), SETTINGS)
    assert again["generated"] == 0 and rows(out) == written


# Under make test-reliability only (a minute of two target replicas): make test keeps the replicas'
# split of the work through the feature cache's (tests/dflash/data/test_feature_cache.py).
@pytest.mark.slow
@pytest.mark.reliability_full
def test_two_replicas_write_what_one_writes(demo_dir, prompts, tmp_path):
    path, _ = prompts
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    regenerate(str(demo_dir / "target"), str(path), str(one), SETTINGS)
    assert regenerate(str(demo_dir / "target"), str(path), str(two), SETTINGS, replicas=2)["rows"] == 5
    assert rows(two) == rows(one)


def test_sampling_is_reproducible_with_its_seed(demo_dir, prompts, tmp_path):
    path, _ = prompts
    sampled = GenerationSettings(max_new_tokens=12, batch_size=2, temperature=1.0, seed=3)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    regenerate(str(demo_dir / "target"), str(path), str(first), sampled)
    regenerate(str(demo_dir / "target"), str(path), str(second), sampled)
    assert rows(first) == rows(second)


def test_cli_help_and_bad_prompts(demo_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as help_exit:
        data_main(["regenerate", "--help"])
    assert help_exit.value.code == 0 and "--prompts" in capsys.readouterr().out
    assert data_main(["--help"]) == 0 and "regenerate" in capsys.readouterr().out
    assert data_main(["nonsense"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n{"messages": "hello"}\n')
    code = data_main(["regenerate", "--target", str(demo_dir / "target"), "--prompts", str(bad),
                      "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:2:" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()
