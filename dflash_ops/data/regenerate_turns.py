"""`regenerate --turns all`: every assistant turn of a multi-turn chat answered by the target, in order, and
scored (as SpecForge scores every assistant turn); `dflash_ops.data.regenerate` calls `run_all_turns` for
its in-process path (`--engine hf`) in place of the one-answer-per-prompt loop.

Turn k's prompt is the chat up to its k-th assistant message with the target's own earlier answers in place
of the dataset's (decoded, without special tokens, and rendered by the chat template as any assistant
message is), through the template with the generation prompt and the thinking mode; the last turn answers
the chat's end (a trailing assistant message is dropped, as with `--turns last`). The row is the last
turn's prompt and answer, `loss_mask` 1 on the last answer's tokens and on each earlier answer's tokens in
the prompt with the special end-of-turn token the template writes after it
(`dflash_ops.data.dataset_answers.masked_tokens`). A chat with a turn's prompt of `max_length` tokens or
more is skipped and counted (`skipped_too_long`); one whose earlier answer the template does not render
verbatim is skipped and counted (`skipped_unlocated`). Chats are answered in batches of `batch_size`,
turn by turn (all first answers of the batch together, then the second ones, ...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash_ops.data.chat_prompts import (
    GenerationSettings,
    answer_bound,
    load_tokenizer,
    part_path,
    read_chats,
    read_rows,
)
from dflash_ops.data.dataset_answers import assistant_spans, masked_tokens, render
from dflash_ops.data.generation import end_of_text_ids, generate_batch

TURNS = ("last", "all")


def turn_ends(chat: list[dict]) -> list[int]:
    """The length of the chat before each turn to answer: at each assistant message, and at its end."""
    return [k for k, message in enumerate(chat) if message["role"] == "assistant"] + [len(chat)]


def prompt_of(tokenizer, chat: list[dict], options: dict) -> tuple[list[int], list[int]] | None:
    """(ids, mask) of `chat` (ending before the turn to answer) with the generation prompt: 1 on the
    earlier assistant answers; None when one is not where its turn is."""
    text = render(tokenizer, chat, options, generation_prompt=True)
    found = assistant_spans(tokenizer, chat, options, text)
    return None if found is None else masked_tokens(tokenizer, *found)


def run_all_turns(replica: int, replicas: int, target_path: str, prompts_path: str, out: str, device: str,
                  dtype: str, settings: GenerationSettings, max_length: int, mode: bool | None,
                  stop=None, load_model=None) -> dict:
    """Answer every turn of the chats `replica::replicas` without a row; rows to the replica's part as
    each batch finishes; stop between two batches once `stop` is requested. Returns counts. `load_model`:
    the target's loader (`dflash_ops.data.target.load_target`, passed in: the target's layer sits beside
    the data readers it imports, and a call from here would close an import circle)."""
    out_path = Path(out)
    tokenizer = load_tokenizer(target_path)
    options = {} if mode is None else {"enable_thinking": mode}
    chats = read_chats(prompts_path)
    part = part_path(out_path, replica)
    done = set(read_rows(out_path)) | set(read_rows(part))
    mine = range(replica, len(chats), replicas)
    todo = [index for index in mine if index not in done and chats[index]]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    model = load_model(target_path, dtype, device)
    eos, pad = end_of_text_ids(model, tokenizer)
    kept = read_rows(part)  # a line cut short by a kill is dropped: rewrite the part without it
    part.write_text("".join(json.dumps(row) + "\n" for row in kept.values()))
    counts = {"generated": 0, "turns": 0, "skipped_done": len(done & set(mine)), "skipped_too_long": 0,
              "skipped_unlocated": 0}
    with part.open("a") as sink:
        for first in range(0, len(todo), settings.batch_size):
            if stop is not None and stop.requested:
                counts["stopped"] = True
                break
            torch.manual_seed(settings.seed + todo[first])
            batch = todo[first: first + settings.batch_size]
            live = {index: [dict(m) for m in chats[index]] for index in batch}
            ends = {index: turn_ends(chat) for index, chat in live.items()}
            rows = {}
            for turn in range(max(map(len, ends.values()))):
                asked = {}
                for index in [i for i in live if turn < len(ends[i])]:
                    at = ends[index][turn]
                    built = prompt_of(tokenizer, live[index][:at], options)
                    if built is None or len(built[0]) >= max_length:
                        counts["skipped_unlocated" if built is None else "skipped_too_long"] += 1
                        del live[index]
                        continue
                    asked[index] = built
                if not asked:
                    break
                budget = answer_bound(settings, max_length, max(len(ids) for ids, _ in asked.values()))
                bounded = GenerationSettings(budget, settings.batch_size, settings.temperature,
                                             settings.top_p, settings.seed)
                responses = generate_batch(model, [ids for ids, _ in asked.values()], bounded, eos, pad)
                counts["turns"] += len(asked)
                for (index, (ids, mask)), response in zip(asked.items(), responses, strict=True):
                    at = ends[index][turn]
                    if turn + 1 == len(ends[index]):  # the last turn: the row
                        rows[index] = {"id": index, "input_ids": ids + response,
                                       "loss_mask": mask + [1] * len(response)}
                        continue
                    answer = tokenizer.decode(response, skip_special_tokens=True)
                    live[index][at] = {"role": "assistant", "content": answer}
            for index in sorted(rows):
                sink.write(json.dumps(rows[index]) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            counts["generated"] += len(rows)
    return counts
