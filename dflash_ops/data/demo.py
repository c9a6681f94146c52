"""Demo and test assets built from text every machine has, with no downloads.

`python -m dflash_ops.demo prepare <dir>` writes:

- `<dir>/target/`: a tiny Qwen3 target trained briefly on CPU on the Python standard library's source,
  with its BPE tokenizer (loadable by `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained`);
- `<dir>/data/train.jsonl`, `<dir>/data/eval.jsonl`: prompts cut from the corpus with responses
  regenerated greedily by that target, `{"input_ids": [...], "loss_mask": [...]}` (1 on responses);
- `<dir>/data/prompts.jsonl` and `<dir>/data/eval_prompts.jsonl`: the training and the held-out
  prompts as chats (`{"messages": [{"role": "user", "content": <the prompt's text>}]}`), the input of
  `python -m dflash_ops.data regenerate`. The demo tokenizer's chat template is the messages' text as it
  is: the demo target continues code. The `thinking` presets teach it Qwen3's two chat modes instead
  (`dflash_ops.data.demo_thinking`), and their rows are the non-thinking mode's answers;
- `<dir>/config.yaml`: a training config for this demo;
- `<dir>/demo.json`: the parameters it was built with. A second call with the same parameters
  returns at once; different parameters rebuild.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.data.demo_thinking import CHAT_TEMPLATE as THINKING_CHAT_TEMPLATE
from dflash_ops.data.demo_thinking import THINK_CLOSE, THINK_OPEN, line_prompt, with_think_blocks

# Bump when the way the assets are built changes, so that stale caches rebuild.
ASSETS_VERSION = 5  # 3 was a thinking toggle that the demo target was never taught (withdrawn)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
# The demo target is a code model without roles: a chat is its messages' text, and it continues it.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class DemoSpec:
    """Everything that decides the assets; the cache key."""

    corpus_chars: int = 3_000_000  # characters of standard-library source used as the corpus
    vocab_size: int = 1024
    hidden_size: int = 96
    num_layers: int = 4
    # head_dim 32: vLLM's CPU attention runs head sizes 32, 64, 80, ... only (docs/SERVING.md).
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 256
    train_seq_len: int = 128
    train_batch_size: int = 16
    train_steps: int = 600
    learning_rate: float = 3e-3
    num_train: int = 4096  # regenerated training sequences (the drafter sees each about 4 times)
    num_eval: int = 32  # held-out prompts (from files the training prompts never use)
    prompt_len: int = 48
    response_len: int = 64
    seed: int = 0
    thinking: bool = False  # taught Qwen3's two chat modes (dflash_ops.data.demo_thinking)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("seed", "thinking") and not value > 0:
                raise ValueError(f"demo: {field.name} must be positive, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"demo: hidden_size {self.hidden_size} is not a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"demo: num_heads {self.num_heads} is not a multiple of num_kv_heads")


# For tests: a few seconds.
TINY = DemoSpec(
    corpus_chars=400_000, vocab_size=384, hidden_size=64, num_heads=2, num_kv_heads=1,
    intermediate_size=128, num_layers=3,
    train_seq_len=64, train_batch_size=16, train_steps=120, num_train=96, num_eval=8,
    prompt_len=24, response_len=40,
)
PRESETS = {
    # A few minutes on one core; the drafter trained on it by the demo config reaches 1.8x the tau
    # of prompt lookup (docs/PIPELINE.md).
    "default": DemoSpec(),
    "tiny": TINY,
    # The target of the thinking-mode benchmark (benchmarks/thinking_mode.py), and its tests' size.
    "thinking": DemoSpec(thinking=True),
    "tiny-thinking": dataclasses.replace(TINY, thinking=True),
}


def _log(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def stdlib_sources(max_chars: int) -> list[str]:
    """The standard library's `.py` files in a fixed order, up to `max_chars` characters in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if path.parent.name in ("test", "tests") or path.name.startswith("test"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 2000:
            continue
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"demo: no Python source found under {root}")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, thinking: bool = False):
    """A byte-level BPE tokenizer, wrapped so that `save_pretrained` / `AutoTokenizer` understand it;
    with `thinking`, `<think>` and `</think>` are special tokens too, as in Qwen3's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, MASK_TOKEN, *((THINK_OPEN, THINK_CLOSE) if thinking else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, mask_token=MASK_TOKEN
    )


def encode_corpus(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in texts]


def build_target(spec: DemoSpec, vocab_size: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=max(512, 2 * (spec.prompt_len + spec.response_len)),
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    return Qwen3ForCausalLM(config)


def train_target(model, docs: list[list[int]], spec: DemoSpec, progress: bool) -> float:
    """A short language-model training on random windows of the corpus; returns the final loss."""
    import torch

    stream = torch.tensor([token for doc in docs for token in doc], dtype=torch.long)
    window = spec.train_seq_len + 1
    if len(stream) <= window:
        raise RuntimeError("demo: the corpus is shorter than one training window")
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    warmup = max(1, spec.train_steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, spec.train_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    loss_ema = None
    started = time.monotonic()
    for step in range(spec.train_steps):
        starts = torch.randint(0, len(stream) - window, (spec.train_batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if progress and (step % 20 == 0 or step == spec.train_steps - 1):
            elapsed = time.monotonic() - started
            print(f"\rtarget training {step + 1}/{spec.train_steps}  loss {loss_ema:.3f}  {elapsed:.0f}s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    model.eval()
    return float(loss_ema)


def sample_prompts(docs: list[list[int]], count: int, length: int, rng: random.Random) -> list[list[int]]:
    """`count` windows of `length` tokens, each from a random place in a random document."""
    usable = [doc for doc in docs if len(doc) > length + 1]
    if not usable:
        raise RuntimeError(f"demo: no document is longer than the prompt length {length}")
    prompts = []
    for _ in range(count):
        doc = rng.choice(usable)
        start = rng.randrange(0, len(doc) - length - 1)
        prompts.append(doc[start : start + length])
    return prompts


def write_jsonl(path: Path, prompts: list[list[int]], responses: list[list[int]]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as out:
        for prompt, response in zip(prompts, responses, strict=True):
            record = {"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)}
            out.write(json.dumps(record) + "\n")
    tmp.replace(path)


def write_config(out_dir: Path, spec: DemoSpec) -> Path:
    """A ready training config for the demo target (single process; the pipeline keys are present)."""
    import yaml

    block_size = 8
    config = {
        "model": {
            "target_path": str(out_dir / "target"),
            "num_draft_layers": 1,
            "block_size": block_size,
            "target_layer_ids": None,
            "mask_token_id": None,
            "dtype": "float32",
        },
        "data": {
            "path": str(out_dir / "data" / "train.jsonl"),
            "max_length": spec.prompt_len + spec.response_len,
            # Small batches, many steps: at this size the drafter learns more per second from more
            # optimizer steps than from more blocks per step.
            "batch_size": 4,
            "max_anchors": 32,
            "eval_path": str(out_dir / "data" / "eval.jsonl"),
            "eval_examples": 16,
        },
        "optim": {
            "lr": 3.0e-3,
            "weight_decay": 0.0,
            "warmup_ratio": 0.04,
            "max_grad_norm": 1.0,
            "total_steps": 4000,
            "gamma": None,
        },
        "run": {
            "output_dir": str(out_dir / "runs" / "demo"),
            "save_every": 500,
            "keep_checkpoints": 3,
            "log_every": 50,
            "eval_every": 500,
            "seed": 0,
            "resume": True,
            "max_steps_per_run": None,
            "step_delay": 0.0,
        },
        "pipeline": {
            "device": "cpu",
            "target_gpus": [],
            "drafter_gpus": [],
            "target_workers": 0,
            "drafter_workers": 0,
            "queue_depth": 4,
            "threads_per_worker": 1,
        },
    }
    path = out_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _cache_record(spec: DemoSpec) -> dict:
    return {"version": ASSETS_VERSION, "spec": dataclasses.asdict(spec)}


def is_prepared(out_dir: Path, spec: DemoSpec) -> bool:
    marker = out_dir / "demo.json"
    required = [out_dir / "target" / "config.json", out_dir / "data" / "train.jsonl",
                out_dir / "data" / "eval.jsonl", out_dir / "data" / "prompts.jsonl",
                out_dir / "data" / "eval_prompts.jsonl", out_dir / "config.yaml"]
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("build") == _cache_record(spec) and all(p.exists() for p in required)


def prepare(out_dir: str | os.PathLike, spec: DemoSpec = PRESETS["default"], threads: int = 1,
            progress: bool | None = None) -> Path:
    """Build the demo assets in `out_dir` (or reuse them); returns the path of its `config.yaml`."""
    out_dir = Path(out_dir).resolve()
    if is_prepared(out_dir, spec):
        _log("demo_cached", dir=str(out_dir))
        return out_dir / "config.yaml"
    import torch

    from dflash_ops.data.regenerate import GenerationSettings, generate_batch

    progress = sys.stderr.isatty() if progress is None else progress
    torch.set_num_threads(threads)
    started = time.monotonic()
    (out_dir / "demo.json").unlink(missing_ok=True)
    (out_dir / "data").mkdir(parents=True, exist_ok=True)

    texts = stdlib_sources(spec.corpus_chars)
    # The last tenth of the files is held out: evaluation prompts come only from there.
    held_out = max(1, len(texts) // 10)
    tokenizer = train_tokenizer(texts, spec.vocab_size, spec.thinking)
    docs = encode_corpus(tokenizer, texts)
    train_docs, eval_docs = docs[:-held_out], docs[-held_out:]
    # The thinking target learns from the corpus with think blocks in it; prompts stay plain code.
    target_docs = encode_corpus(tokenizer, [with_think_blocks(text, random.Random(spec.seed + i))
                                            for i, text in enumerate(texts[:-held_out])]) \
        if spec.thinking else train_docs
    _log("demo_corpus", files=len(texts), tokens=sum(map(len, docs)), vocab_size=len(tokenizer))

    model = build_target(spec, len(tokenizer))
    final_loss = train_target(model, target_docs, spec, progress)
    _log("demo_target", loss=round(final_loss, 4), parameters=sum(p.numel() for p in model.parameters()),
         seconds=round(time.monotonic() - started, 1))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its bar would go to the log as noise
    model.save_pretrained(out_dir / "target")
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE if spec.thinking else CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir / "target")

    rng = random.Random(spec.seed)
    settings = GenerationSettings(max_new_tokens=spec.response_len, batch_size=32)
    for name, pool, count in (("train", train_docs, spec.num_train), ("eval", eval_docs, spec.num_eval)):
        prompts = sample_prompts(pool, count, spec.prompt_len, rng)
        chats = [{"messages": [{"role": "user", "content": tokenizer.decode(p)}]} for p in prompts]
        if spec.thinking:
            # Whole lines, through the chat template in the non-thinking mode (data.enable_thinking's
            # default).
            for chat in chats:
                chat["messages"][0]["content"] = line_prompt(chat["messages"][0]["content"])
            prompts = [list(tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True,
                                                          enable_thinking=False, tokenize=True,
                                                          return_dict=True)["input_ids"]) for chat in chats]
        responses = []
        for first in range(0, len(prompts), settings.batch_size):
            responses += generate_batch(model, prompts[first: first + settings.batch_size], settings,
                                        [tokenizer.eos_token_id], tokenizer.pad_token_id)
        write_jsonl(out_dir / "data" / f"{name}.jsonl", prompts, responses)
        chats_name = "prompts.jsonl" if name == "train" else "eval_prompts.jsonl"
        (out_dir / "data" / chats_name).write_text("".join(json.dumps(c) + "\n" for c in chats))
    config_path = write_config(out_dir, spec)
    seconds = round(time.monotonic() - started, 1)
    record = {"build": _cache_record(spec), "seconds": seconds}
    (out_dir / "demo.json").write_text(json.dumps(record, indent=1))
    _log("demo_ready", dir=str(out_dir), config=str(config_path), seconds=seconds)
    return config_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ops.demo",
        description="Build the demo target, tokenizer, regenerated data and config from local text.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="build (or reuse) the demo assets in DIR")
    prep.add_argument("dir", help="output directory (created if missing)")
    prep.add_argument("--preset", choices=sorted(PRESETS), default="default",
                      help="asset sizes: 'default' (about 1-2 minutes on one core) or 'tiny' (tests); "
                           "'thinking' and 'tiny-thinking': a target taught Qwen3's two chat modes")
    prep.add_argument("--target-steps", type=int, help="override the target's training steps")
    prep.add_argument("--num-train", type=int, help="override the number of training sequences")
    prep.add_argument("--seed", type=int, help="override the seed")
    prep.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)

    overrides = {"train_steps": args.target_steps, "num_train": args.num_train, "seed": args.seed}
    try:
        chosen = {key: value for key, value in overrides.items() if value is not None}
        spec = dataclasses.replace(PRESETS[args.preset], **chosen)
        prepare(args.dir, spec, threads=args.threads)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
