"""Training data from a dataset's own answers, without regenerating them:
`python -m dflash_ops.data tokenize --target DIR --chats CHATS.jsonl --out TRAIN.jsonl`.

For teams that have answers they want the drafter trained on (the target's own, generated elsewhere, or a
dataset's). It reads the chat formats `regenerate --prompts` reads (`dflash_ops.data.chat_formats`: JSON
lines of messages or ShareGPT/SpecForge conversations, parquet, Arrow), keeps each chat up to its last
assistant message, renders it through the target tokenizer's chat template (the thinking mode as
`regenerate` gives it: `--enable-thinking`, nothing for a template without the toggle) and writes one row
per chat, `{"id": <row index>, "input_ids", "loss_mask"}`, the format `dflash_ops.train` reads.

The loss mask is 1 on every assistant turn (all of them, as SpecForge scores a multi-turn chat): the
tokens of the turn's content and the end-of-turn token the template writes right after it (the first
token after the content, where it is a special token such as `<|im_end|>`); 0 on everything else (the
system and user turns, the role headers, a think block the template adds). A turn's content is found in
the rendered text after the text of the chat before it; a turn the template does not render verbatim
(a think block it moves away, say) leaves the row skipped and counted (`unlocated`). Rows longer than
`--max-length` (default: the `--config`'s data.max_length, else regenerate's default) are skipped and
counted, as are chats without an assistant message. The tokenizer must be a fast one (its offsets).

Beside the output, `<out>.manifest.json` in `dflash_ops.data.data_manifest`'s format (so that a run's
`data.enable_thinking` is checked against it): the target, the chats, the mode, `answers: "dataset"`,
the max length, the counts and `rows`. Both files are written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dflash_ops.core.config import load_config, local_model_problem, target_text_config
from dflash_ops.data.chat_formats import read_chat_rows
from dflash_ops.data.chat_prompts import load_tokenizer
from dflash_ops.data.data_manifest import FORMAT, manifest_path
from dflash_ops.data.feature_cache import write_json
from dflash_ops.data.generation import DEFAULT_MAX_LENGTH, thinking_mode


def render(tokenizer, messages: list[dict], options: dict, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **options)


def assistant_spans(tokenizer, chat: list[dict], options: dict,
                    text: str | None = None) -> tuple[str, list[tuple[int, int]]] | None:
    """(the chat's text through the template, or `text`, the character span of each assistant turn's content
    in it); None when a turn's content is not in the text where its turn is."""
    text = render(tokenizer, chat, options) if text is None else text
    spans, cursor = [], 0
    for k, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, chat[:k], options) if k else ""
        if text.startswith(before):  # the turn starts where the chat before it ends
            cursor = max(cursor, len(before))
        content = message["content"]
        start = text.find(content, cursor) if content else -1
        if start < 0:
            if not content.strip():
                continue  # an empty answer: nothing to score
            return None
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return text, spans


def tokenize_chat(tokenizer, chat: list[dict], options: dict) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask) of a chat ending with an assistant message: 1 on each assistant turn's content
    tokens and the special end-of-turn token right after them; None when a turn cannot be located."""
    found = assistant_spans(tokenizer, chat, options)
    return None if found is None else masked_tokens(tokenizer, *found)


def masked_tokens(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(the ids of `text`, 1 on the tokens of each character span and the special token right after it)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    added = getattr(tokenizer, "added_tokens_decoder", {})
    specials = set(tokenizer.all_special_ids) | {int(i) for i, token in added.items() if token.special}
    mask = [0] * len(ids)
    for start, end in spans:
        last = None
        for at, (a, b) in enumerate(offsets):
            if b > start and a < end and b > a:
                mask[at], last = 1, at
        if last is not None and last + 1 < len(ids) and ids[last + 1] in specials:
            mask[last + 1] = 1  # the end of the turn: what stops the target's answer
    return ids, mask


def tokenize(target: str, chats: str, out: str, max_length: int | None = None,
             enable_thinking: bool = False) -> dict:
    """Write the rows of `chats`' own answers to `out` (and its manifest); returns the counts."""
    problem = local_model_problem(target, "--target")
    if problem:
        raise ValueError(f"--target: {problem}")
    positions = target_text_config(target).get("max_position_embeddings")
    positions = positions if isinstance(positions, int) else None
    if max_length is None:
        max_length = min(DEFAULT_MAX_LENGTH, positions or DEFAULT_MAX_LENGTH)
    if max_length < 2:
        raise ValueError(f"--max-length must be >= 2, got {max_length}")
    mode, takes = thinking_mode(target, enable_thinking)
    tokenizer = load_tokenizer(target)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"the tokenizer at {target} is not a fast tokenizer: its offsets locate the answers")
    options = {} if mode is None else {"enable_thinking": mode}
    counts = {"rows": 0, "skipped_too_long": 0, "skipped_no_answer": 0, "skipped_unlocated": 0,
              "answer_tokens": 0}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    try:
        with partial.open("w") as sink:
            for index, messages in enumerate(read_chat_rows(chats)):
                answered = [k for k, m in enumerate(messages or []) if m["role"] == "assistant"]
                if not answered:
                    counts["skipped_no_answer"] += 1
                    continue
                row = tokenize_chat(tokenizer, messages[: answered[-1] + 1], options)
                if row is None:
                    counts["skipped_unlocated"] += 1
                    continue
                ids, mask = row
                if len(ids) > max_length:
                    counts["skipped_too_long"] += 1
                    continue
                sink.write(json.dumps({"id": index, "input_ids": ids, "loss_mask": mask}) + "\n")
                counts["rows"] += 1
                counts["answer_tokens"] += sum(mask)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, out_path)
    finally:
        partial.unlink(missing_ok=True)
    write_json(manifest_path(out_path), {
        "format": FORMAT, "target": str(target), "prompts": str(chats), "answers": "dataset",
        "enable_thinking": mode, "template_takes_thinking": takes, "turns": "all",
        "tokenize": {"max_length": max_length, **{k: v for k, v in counts.items() if k != "rows"}},
        "rows": counts["rows"]})
    return {**counts, "enable_thinking": mode, "max_length": max_length}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.data tokenize",
        description="Write the training JSON lines of a chat dataset's own answers (no regeneration): the "
                    "target's chat template, loss_mask 1 on every assistant turn.")
    parser.add_argument("--target", required=True, help="the target model directory (with its tokenizer)")
    parser.add_argument("--chats", required=True,
                        help="the chats, in any format regenerate --prompts reads (messages, ShareGPT/"
                             "SpecForge conversations, parquet/Arrow); each is kept up to its last "
                             "assistant message")
    parser.add_argument("--out", required=True,
                        help="the training JSON lines to write (and <out>.manifest.json beside them)")
    parser.add_argument("--enable-thinking", choices=("true", "false"), default="false",
                        help="the chat template's enable_thinking, as regenerate gives it (default false; "
                             "a template without the toggle is given nothing, and true is then an error)")
    parser.add_argument("--config", metavar="RUN.yaml",
                        help="the run's config: its data.max_length is the default --max-length")
    parser.add_argument("--max-length", type=int,
                        help="a longer row is skipped and counted (default: the --config's "
                             "data.max_length, else regenerate's default)")
    args = parser.parse_args(argv)
    try:
        max_length = args.max_length or (load_config(args.config, check_target=False).data.max_length
                                         if args.config else None)
        summary = tokenize(args.target, args.chats, args.out, max_length,
                           enable_thinking=args.enable_thinking == "true")
    except (OSError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"event": "tokenized", "out": args.out, **summary}))
    return 0
