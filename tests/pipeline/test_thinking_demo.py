"""The thinking demo (`dflash_ops.demo prepare --preset tiny-thinking`, `dflash_ops.data.demo_thinking`): a
demo target whose chat template is Qwen3's generation prompt with its `enable_thinking` toggle, taught both
modes; its data regenerated in each mode, a drafter trained on one, exported with the mode recorded,
and evaluated in both, as `benchmarks/thinking_mode.py` does at the full demo size."""

from __future__ import annotations

import json
import random
import re

import pytest
import yaml
from transformers import AutoTokenizer

from dflash_ops.core.config import load_config
from dflash_ops.data.demo import PRESETS, prepare
from dflash_ops.data.demo_thinking import (
    CHAT_TEMPLATE,
    NO_THOUGHT,
    THINK_CLOSE,
    THINK_OPEN,
    line_prompt,
    thought,
    with_think_blocks,
)
from dflash_ops.data.regenerate import GenerationSettings, regenerate, template_takes_thinking
from dflash_ops.run.main import main as train_main
from dflash_ops.serve.evaluate import evaluate
from dflash_ops.serve.export import export_checkpoint

BLOCK = re.compile(re.escape(THINK_OPEN) + r"\n(.*?)" + re.escape(THINK_CLOSE) + r"\n\n", re.S)
SOURCE = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 8


def test_think_blocks_stand_between_lines_and_plan_the_lines_after_them():
    marked = with_think_blocks(SOURCE, random.Random(3))
    assert BLOCK.sub("", marked) == SOURCE  # the code is all there, in order
    thoughts = [m for m in BLOCK.finditer(marked) if m.group(1) != "\n"]
    empty = [m for m in BLOCK.finditer(marked) if m.group(0) == NO_THOUGHT]
    assert thoughts and empty, "both modes are taught"
    for block in BLOCK.finditer(marked):
        assert block.start() == 0 or marked[block.start() - 1] == "\n"
    for block in thoughts:  # a thought is the plan of the lines that follow it
        after = BLOCK.sub("", marked[block.end():]).splitlines(keepends=True)
        assert block.group(1) == thought(after[:6])
    assert thought(["def add(a, b):\n", "\n", "    return a + b\n"]) == "- def add a b\n- return a b\n"
    assert line_prompt("x = 1\ny = ") == "x = 1\n" and line_prompt("no line end") == "no line end"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("thinking-demo"), PRESETS["tiny-thinking"]).parent


def test_the_chat_template_is_qwen3s_generation_prompt(demo):
    tokenizer = AutoTokenizer.from_pretrained(demo / "target")
    assert template_takes_thinking(tokenizer.chat_template) and tokenizer.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "x = 1\n"}]

    def render(**options):
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **options)

    assert render(enable_thinking=False) == "x = 1\n" + NO_THOUGHT
    # Qwen3 thinks unless told not to.
    assert render(enable_thinking=True) == render() == "x = 1\n" + THINK_OPEN + "\n"
    think, end_think = tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
    assert think != tokenizer.unk_token_id and len({think, end_think, tokenizer.eos_token_id}) == 3
    # The demo's own rows are the non-thinking mode's (data.enable_thinking's default).
    rows = [json.loads(line) for line in (demo / "data" / "train.jsonl").read_text().splitlines()]
    closing = tokenizer(NO_THOUGHT)["input_ids"]
    for row in rows:
        prompt = row["input_ids"][: row["loss_mask"].index(1)]
        assert prompt[-len(closing):] == closing


def test_regenerate_train_export_and_evaluate_in_each_mode(demo, tmp_path, capsys):
    settings = GenerationSettings(max_new_tokens=16, batch_size=4)
    data = {}
    for mode in (False, True):
        data[mode] = tmp_path / f"data-{mode}"
        data[mode].mkdir()
        for name, chats in (("train", "prompts.jsonl"), ("eval", "eval_prompts.jsonl")):
            summary = regenerate(str(demo / "target"), str(demo / "data" / chats),
                                 str(data[mode] / f"{name}.jsonl"), settings, enable_thinking=mode)
            assert summary["enable_thinking"] is mode and summary["rows"] > 0
    tokenizer = AutoTokenizer.from_pretrained(demo / "target")
    open_only, closed = tokenizer(THINK_OPEN + "\n")["input_ids"], tokenizer(NO_THOUGHT)["input_ids"]
    prompts = {}
    for mode, suffix in ((False, closed), (True, open_only)):
        rows = [json.loads(line) for line in (data[mode] / "eval.jsonl").read_text().splitlines()]
        prompts[mode] = [row["input_ids"][: row["loss_mask"].index(1)] for row in rows]
        assert all(p[-len(suffix):] == suffix for p in prompts[mode])
    assert prompts[False] != prompts[True]

    # A drafter trained on the thinking answers records the mode in its checkpoint and export.
    raw = yaml.safe_load((demo / "config.yaml").read_text())
    raw["data"].update(path=str(data[True] / "train.jsonl"), eval_path=str(data[True] / "eval.jsonl"),
                       enable_thinking=True, batch_size=4, max_anchors=16)
    raw["optim"].update(total_steps=4, warmup_ratio=0.0)
    raw["run"].update(output_dir=str(tmp_path / "run"), save_every=4, eval_every=4, log_every=1)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert train_main(["--config", str(config)]) == 0
    capsys.readouterr()
    out = export_checkpoint(next((tmp_path / "run" / "checkpoints").iterdir()), tmp_path / "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["dflash_training"]["enable_thinking"] is True
    assert exported["dflash_training"]["enable_thinking_confirmed"] is True  # the regenerated data's manifest
    readme = (out / "README.md").read_text()
    assert "learnt from the target's thinking answers" in readme and "`enable_thinking=True`" in readme
    assert "no data manifest confirmed" not in readme
    assert "non-thinking" not in readme

    # It serves in either mode: the held-out prompts of each, as benchmarks/thinking_mode.py evaluates them.
    cfg = load_config(config)
    for mode in (False, True):
        result = evaluate(cfg, tmp_path / "run", data[mode] / "eval.jsonl", 8, num_prompts=2,
                          include_target=False)
        trained = next(row for row in result["rows"] if row["name"] == "trained drafter")
        assert result["prompts"] == 2 and trained["verify_steps"] > 0
