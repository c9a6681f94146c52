"""The thinking demo: a demo target taught both of Qwen3's chat modes, so that `enable_thinking` changes
what it answers, as it does for a Qwen3 target.

Qwen3's chat template takes `enable_thinking`: false closes an empty `<think>\\n\\n</think>\\n\\n` block
in the generation prompt (the answer follows at once), anything else leaves the thinking to the model,
which writes a thought first and closes the block itself. The demo target continues code; here its
corpus carries a think block at random line boundaries, half of them empty (non-thinking mode) and
half with a thought: a plan of the coming lines, one line of their identifiers each (`- name name`),
a text that reads unlike the code after it, as a Qwen3 thought reads unlike its answer. Its chat
template is Qwen3's generation prompt without the roles (the demo target has none).

`python -m dflash_ops.demo prepare DIR --preset thinking` builds it; `benchmarks/thinking_mode.py`
regenerates its data in each mode, trains a drafter on each and serves each in both modes.
"""

from __future__ import annotations

import random
import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Qwen3's generation prompt for a model without roles; the toggle's test is Qwen3's own
# (`enable_thinking is defined and enable_thinking is false`), so an absent toggle means thinking. The
# line ends are string literals, as in Qwen3's template: transformers renders with trim_blocks, which
# drops a line end that follows a block tag.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + THINK_OPEN + "\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '\\n" + THINK_CLOSE + "\\n\\n' }}"
    "{% endif %}{% endif %}"
)
NO_THOUGHT = THINK_OPEN + "\n\n" + THINK_CLOSE + "\n\n"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLAN_LINES = 6  # the lines a thought plans
GAP_LINES = (4, 12)  # lines between two think blocks, drawn uniformly


def thought(lines: list[str]) -> str:
    """The plan of `lines`: for each line with a name in it, `- ` and its names, then a line end."""
    plans = (IDENTIFIER.findall(line) for line in lines)
    return "".join("- " + " ".join(names) + "\n" for names in plans if names)


def with_think_blocks(text: str, rng: random.Random) -> str:
    """`text` with a think block before every few lines: half of them a thought on the coming lines
    (thinking mode), half empty (non-thinking mode), each closed by `</think>` and a blank line."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    next_block = rng.randint(*GAP_LINES)
    for index, line in enumerate(lines):
        if index == next_block:
            plan = thought(lines[index: index + PLAN_LINES])
            out.append(THINK_OPEN + "\n" + plan + THINK_CLOSE + "\n\n" if plan and rng.random() < 0.5
                       else NO_THOUGHT)
            next_block = index + rng.randint(*GAP_LINES)
        out.append(line)
    return "".join(out)


def line_prompt(text: str) -> str:
    """A prompt cut at its last line end, as the corpus's think blocks stand after one (the text as it
    is when it has none)."""
    end = text.rfind("\n")
    return text[: end + 1] if end > 0 else text
