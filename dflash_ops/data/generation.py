"""The target's generation, shared by regeneration's paths (`regenerate`, every turn of a chat in
`regenerate_turns`) and the dataset's own answers (`dataset_answers`): the ids that end an answer, a batch
generated with transformers, the default length bound, and the chat template's thinking mode."""

from __future__ import annotations

import torch

from dflash_ops.data.chat_prompts import GenerationSettings, load_tokenizer

# The prompt + answer bound without --max-length or --config: the paper's recipe's (docs/SCALE.md).
DEFAULT_MAX_LENGTH = 3072


class ThinkingModeError(ValueError):
    """The thinking mode asked for cannot be given to the template, or is not the one of the rows
    the call would resume from."""


def end_of_text_ids(model, tokenizer) -> tuple[list[int], int]:
    """(the ids that end an answer: the target's generation config's, every one of a list, as vLLM stops at
    each, else the tokenizer's end of text; the id that pads a batch: the tokenizer's, else the first end)."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos = tokenizer.eos_token_id if eos is None else eos
    ends = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    return ends, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (ends[0] if ends else 0)


def generate_batch(model, prompts: list[list[int]], settings: GenerationSettings, eos_ids: list[int],
                   pad_id: int) -> list[list[int]]:
    """The target's response to each prompt (token ids), generated together, left-padded; each ends with
    its first id of `eos_ids` (kept) or after settings.max_new_tokens."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    device = model.get_input_embeddings().weight.device
    # top_k 0: no top-k cut (generate's default is 50), as vLLM samples: temperature and top-p alone.
    sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0} \
        if settings.temperature > 0 else {"do_sample": False}
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=settings.max_new_tokens, eos_token_id=eos_ids or None,
                             pad_token_id=pad_id, **sampling)
    responses = []
    for row in out[:, width:].tolist():
        ends = [at for at, token in enumerate(row) if token in eos_ids]
        responses.append(row[: ends[0] + 1] if ends else row)
    return responses


def template_takes_thinking(template: str | dict) -> bool:
    """Whether a chat template reads `enable_thinking`: a Jinja template reads its keyword arguments
    by name, so its text names the ones it takes (a dict holds several named templates)."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any("enable_thinking" in text for text in texts)


def thinking_mode(target_path: str, enable_thinking: bool) -> tuple[bool | None, bool]:
    """(the mode the template is given: None when it takes none, whether it takes one)."""
    takes = template_takes_thinking(load_tokenizer(target_path).chat_template)
    if enable_thinking and not takes:
        raise ThinkingModeError(f"--enable-thinking true: the chat template of {target_path} has no "
                                "enable_thinking toggle, so its thinking mode cannot be chosen; leave it "
                                "false (the mode recorded is then null)")
    return (enable_thinking if takes else None), takes
