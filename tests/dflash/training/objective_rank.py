"""One drafter rank of tests/dflash/training/test_global_objective.py, as its own process:
`python objective_rank.py RANK WORLD INIT_FILE SPEC.pt OUT.pt`.

It joins a gloo group of WORLD drafters, trains one step on its shard of SPEC's documents through
`DrafterTrainer` (DDP, as a pipeline's drafter does) and saves its gradients and the step as all drafters
saw it (`reduce_step`)."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, reduce_step


def step_on(trainer: DrafterTrainer, target, documents: list[tuple[list[int], list[int]]], layer_ids):
    """One train_step on `documents` ([(input_ids, loss_mask)]), right-padded into one batch."""
    from dflash_ops.data.target import target_hidden_states

    width = max(len(ids) for ids, _ in documents)
    ids = torch.zeros(len(documents), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for row, (doc, doc_mask) in enumerate(documents):
        ids[row, : len(doc)] = torch.tensor(doc)
        mask[row, : len(doc)] = 1
        loss_mask[row, : len(doc)] = torch.tensor(doc_mask)
    packed = target_hidden_states(target, ids, mask, layer_ids)
    return trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids, packed.pack(ids),
                              packed.pack(loss_mask))


def main(argv: list[str]) -> int:
    rank, world, init_file, spec_path, out_path = int(argv[1]), int(argv[2]), argv[3], argv[4], argv[5]
    spec = torch.load(spec_path, weights_only=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = config_from_dict(spec["config"])
        target = load_target(cfg.model.target_path, "float32")
        torch.manual_seed(0)
        trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg, rank=rank,
                                 process_group=dist.group.WORLD)
        result = step_on(trainer, target, spec["shards"][rank], spec["layer_ids"])
        reduced = reduce_step(result, dist.group.WORLD, torch.device("cpu"))
        grads = {name: p.grad.clone() for name, p in trainer.drafter.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "local": dataclasses.asdict(result),
                    "reduced": dataclasses.asdict(reduced)}, out_path)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
