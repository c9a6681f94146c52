"""The drafter step's kernels and the bytes its elementwise kernels move, beside a baseline revision's.

One run measures, each configuration in a fresh process, the trainer's own step
(`DrafterTrainer.train_step`: groups of documents, forward, chunked head loss, backward, clipping,
AdamW) at the recipe's shape scaled down (width / 8: H 512, 8 and 2 heads of 64, MLP 1536, vocabulary
151936 / 8; documents of 768 tokens, a quarter of 3072, with 128 anchors of 16, the recipe's ratio of
block rows to context rows; k = 5; bf16 autocast over fp32 master weights; the dense block mask, so
that the attention is one SDPA whatever the tree), of the baseline (`git archive <rev> dflash_ops`
into a temporary directory, imported there) and of this tree:

- kernels: the aten operations that move data (views, allocations and host reads left out), counted
  at the dispatcher (a `TorchDispatchMode`: what the CPU profiler lists as leaf operations) over one
  whole step, forward and backward, clipping and AdamW;
- elementwise bytes per layer: what those operations read and write (their tensors' sizes and dtypes),
  for the elementwise ones (everything but matmuls, attention and the embedding) inside the draft
  layers, forward and backward (the backward's operations are attributed through hooks on the autograd
  nodes each layer created), divided by the layers;
- two ways each tree runs: as on CPU (everything as written) and as on CUDA, where this tree compiles
  its regions (`dflash_ops.model.drafter.compiled_regions`, the one-pass cross entropy) and runs AdamW
  fused, and the baseline runs AdamW's foreach path. A compiled region is counted at its boundary:
  one kernel forward reading its inputs and writing its outputs, and backward one or two kernels
  (two where a norm's weight gradient is a second reduction) reading the outputs' gradients and its
  inputs and writing the inputs' gradients (what Inductor's fused kernels move at best: modelled);
- the CPU step time (the fastest of `--repeats` steps, no census running) of each tree as on CPU;
- on CUDA only (`--gpu`): samples/s, MFU (modelled FLOPs over the GPU's dense bf16 peak) and
  `max_memory_reserved` of the trainer's step at the recipe's shape, each tree in its own process.

    python -m benchmarks.drafter_kernels                 # against 411c2db, the main before the change
    python -m benchmarks.drafter_kernels --baseline HEAD~3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "411c2db"
SCALED = dict(hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1536, vocab=151936 // 8, layers=2,
              documents=2, tokens=768, anchors=128, block_size=16, chunk=512)
RECIPE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, layers=5,
              documents=8, tokens=3072, anchors=512, block_size=16, chunk=512)
NO_DATA = {"detach", "alias", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
           "_local_scalar_dense", "lift_fresh", "set_", "resolve_conj", "resolve_neg", "_to_dense",
           "is_nonzero", "_reshape_alias", "_unsafe_view", "view", "t", "transpose", "as_strided", "expand",
           "slice", "select", "unsqueeze", "squeeze", "permute", "split", "unbind", "split_with_sizes"}
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "matmul", "linear"}
EMBEDDING = {"embedding", "embedding_dense_backward"}
# Kernels of a compiled region: forward, backward (a norm's weight gradient: a second reduction).
REGION_KERNELS = {"rms_norm": (1, 2), "attention_inputs": (1, 2), "norm_rope": (1, 2), "mlp_inputs": (1, 2),
                  "silu_mul": (1, 1), "chunk_loss": (2, 0)}


def export_baseline(rev: str, work: Path) -> Path:
    """`dflash_ops` of revision `rev`, unpacked under `work` (its root goes first on sys.path)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "dflash_ops"],
                             capture_output=True, check=True).stdout
    path = work / "tree.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(work, filter="data")
    path.unlink()
    return work


def nbytes(t) -> int:
    return t.numel() * t.element_size()


class Census:
    """Every data-moving aten operation of a step: (scopes, name, bytes), and the compiled regions'
    boundaries (`region_calls`). Scopes are pushed by `scoped` wrappers in the forward and by hooks on
    the autograd nodes they created in the backward."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        census = self
        self.stack: list[str] = []
        self.ops: list[tuple[tuple[str, ...], str, int]] = []
        self.region_calls: list[tuple[tuple[str, ...], str, int, int]] = []  # scopes, name, fwd, bwd bytes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._schema.name.split("::")[-1]
                if name not in NO_DATA and not func.is_view:
                    flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
                    size = sum(nbytes(t) for t in flat if isinstance(t, torch.Tensor))
                    census.ops.append((tuple(census.stack), name, size))
                return out

        self.mode = Mode()

    def scoped(self, name: str, fn, boundary: bool = False):
        """`fn` whose operations (forward, and backward through the nodes it created) count under `name`;
        `boundary`: also record the call as a compiled region (its boundary's bytes)."""
        import torch

        def hook_nodes(outputs, inputs):
            seen = {id(t.grad_fn) for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
            todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            visited = set()
            while todo:
                node = todo.pop()
                if node is None or id(node) in visited or id(node) in seen:
                    continue
                visited.add(id(node))
                if type(node).__name__ == "AccumulateGrad":
                    continue
                node.register_prehook(lambda grad_outputs, n=name: self.stack.append(n))
                node.register_hook(lambda grad_inputs, grad_outputs: self.stack.pop() and None)
                todo.extend(next_node for next_node, _ in node.next_functions)

        def wrapped(*args, **kwargs):
            self.stack.append(name)
            try:
                out = fn(*args, **kwargs)
            finally:
                self.stack.pop()
            outputs = out if isinstance(out, tuple) else (out,)
            tensors_in = [a for a in args if isinstance(a, torch.Tensor)]
            if torch.is_grad_enabled():
                hook_nodes(outputs, tensors_in)
            if boundary:
                tensors_out = [t for t in outputs if isinstance(t, torch.Tensor)]
                forward = sum(map(nbytes, tensors_in)) + sum(map(nbytes, tensors_out))
                backward = (sum(nbytes(t) for t in tensors_out if t.requires_grad)
                            + sum(map(nbytes, tensors_in))
                            + sum(nbytes(t) for t in tensors_in if t.requires_grad))
                if name == "chunk_loss":  # its gradient written over the logits: read twice, written once
                    forward, backward = 3 * nbytes(args[0]), 0
                self.region_calls.append((tuple(self.stack), name, forward,
                                          backward if any(t.requires_grad for t in tensors_in) else 0))
            return out

        return wrapped


def classify(scopes: tuple[str, ...], name: str) -> str:
    if "attention" in scopes or "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in MATMUL:
        return "matmul"
    if name in EMBEDDING:
        return "embedding"
    return "elementwise"


def build(shape: dict, precision: str, optimizer_impl: str | None):
    """(trainer, batch) of the tree on sys.path: a random drafter of `shape` and a batch of its documents."""
    import torch

    from dflash_ops.core.config import config_from_dict
    from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
    from dflash_ops.model.loss import BlockBatch
    from dflash_ops.training.trainer import DrafterTrainer, make_scheduler

    torch.manual_seed(0)
    hidden, vocab, device = shape["hidden"], shape["vocab"], torch.device(shape.get("device", "cpu"))
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=shape["intermediate"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                        head_dim=shape["head_dim"], num_layers=shape["layers"], num_target_features=5,
                        block_size=shape["block_size"], mask_token_id=vocab - 1, vocab_size=vocab)
    embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=torch.bfloat16)
    for frozen in (embed, head):
        frozen.requires_grad_(False).weight.normal_(std=0.02)
    with device:
        drafter = DFlashDrafter(cfg, embed, head)
    train = config_from_dict({
        "model": {"target_path": "/nonexistent", "num_draft_layers": shape["layers"],
                  "block_size": shape["block_size"], "dtype": precision, "loss_chunk_size": shape["chunk"]},
        "data": {"path": "/nonexistent", "max_length": shape["tokens"], "batch_size": shape["documents"],
                 "max_anchors": shape["anchors"]},
        "optim": {"lr": 6e-4, "warmup_ratio": 0.0, "total_steps": 100},
        "run": {"output_dir": "/nonexistent", "seed": 0}})
    trainer = DrafterTrainer(drafter, train)
    if optimizer_impl is not None:  # as the device would run it
        params = [p for p in drafter.parameters() if p.requires_grad]
        trainer.optimizer = torch.optim.AdamW(params, lr=6e-4, **{optimizer_impl: True})
        trainer.scheduler = make_scheduler(trainer.optimizer, train.optim, train.total_steps)
    if shape.get("dense_mask"):  # one SDPA per layer whatever the tree's attention
        BlockBatch.block_mask = lambda self, *args, **kwargs: self.attention_mask
    g = torch.Generator().manual_seed(0)
    n = shape["documents"] * shape["tokens"]
    batch = dict(features=torch.randn(n, 5 * hidden, generator=g).to(device, torch.bfloat16),
                 cu_seqlens=torch.arange(0, n + 1, shape["tokens"], dtype=torch.int32),
                 position_ids=torch.arange(shape["tokens"]).repeat(shape["documents"]).to(device),
                 input_ids=torch.randint(0, vocab - 1, (n,), generator=g).to(device),
                 loss_mask=torch.ones(n, dtype=torch.int64, device=device))
    return trainer, batch


def census_of(shape: dict, as_cuda: bool) -> dict:
    """The step's kernels and elementwise bytes per layer (see the module's docstring)."""
    import torch

    import dflash_ops.model.drafter as drafter_module
    from dflash_ops.model import loss as loss_module

    new_tree = hasattr(drafter_module, "Regions")
    trainer, batch = build({**shape, "dense_mask": True}, "bfloat16",
                           ("fused" if new_tree else "foreach") if as_cuda else None)
    census = Census()
    for i, layer in enumerate(trainer.drafter.layers):
        layer.forward = census.scoped(f"layer{i}", layer.forward)
    torch.nn.functional.scaled_dot_product_attention = census.scoped(
        "attention", torch.nn.functional.scaled_dot_product_attention)
    if new_tree:
        regions = drafter_module.Regions(compiled=False)
        for name in regions.NAMES:
            setattr(regions, name, census.scoped(name, getattr(regions, name), boundary=as_cuda))
        for module in trainer.drafter.modules():
            if hasattr(module, "regions"):
                module.regions = regions
        trainer.chunk_loss = census.scoped("chunk_loss", loss_module.softmax_cross_entropy, boundary=as_cuda)
    trainer.train_step(**batch)  # warm-up: the optimizer's state exists, as in every later step
    with census.mode:
        trainer.train_step(**batch)
    profiled = {}
    if not as_cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(**batch)
        profiled = profiled_kernels(prof)
    layers = shape["layers"]
    fused = {name for name in REGION_KERNELS} if as_cuda and new_tree else set()
    kernels, layer_kernels, layer_bytes = 0, 0, 0
    for scopes, name, size in census.ops:
        if fused & set(scopes):
            continue  # inside a compiled region: counted at its boundary below
        kernels += 1
        if any(s.startswith("layer") for s in scopes):
            layer_kernels += 1
            if classify(scopes, name) == "elementwise":
                layer_bytes += size
    for scopes, name, forward, backward in census.region_calls:
        fwd_kernels, bwd_kernels = REGION_KERNELS[name]
        count = fwd_kernels + (bwd_kernels if backward else 0)
        kernels += count
        if any(s.startswith("layer") for s in scopes):
            layer_kernels += count
            layer_bytes += forward + backward
    if shape.get("breakdown"):
        tally = {}
        for scopes, name, size in census.ops:
            if any(s.startswith("layer") for s in scopes) and not fused & set(scopes):
                key = (name, classify(scopes, name))
                count, total = tally.get(key, (0, 0))
                tally[key] = (count + 1, total + size)
        for key, (count, total) in sorted(tally.items(), key=lambda item: -item[1][1]):
            print(f"{key[0]:40s} {key[1]:12s} {count:6d} {total / layers / 1e6:10.3f} MB/layer",
                  file=sys.stderr)
    return {"kernels": kernels, "layer_kernels": layer_kernels / layers, "layer_bytes": layer_bytes / layers,
            **profiled}


def inductor_kernels(shape: dict) -> dict:
    """This tree's step as CUDA runs it, compiled with Inductor on CPU: the kernels a step as torch.profiler
    lists them (leaf aten operations that move data, and Inductor's C++ kernels), the compilations done."""
    import torch
    import torch._inductor.config
    from torch.profiler import ProfilerActivity, profile

    from dflash_ops.model.loss import fused_softmax_cross_entropy

    torch._inductor.config.cpp.enable_kernel_profile = True
    trainer, batch = build({**shape, "dense_mask": True}, "bfloat16", "fused")
    trainer.drafter.compile_regions(True)
    trainer.chunk_loss = fused_softmax_cross_entropy
    for _ in range(2):  # compiled, then a step as every later one
        trainer.train_step(**batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(**batch)
    return profiled_kernels(prof)


def profiled_kernels(prof) -> dict:
    """The kernels of a profiled step: leaf aten operations that move data, and Inductor's C++ kernels."""
    aten = inductor = 0
    for event in prof.events():
        if "cpp_fused" in event.name:
            inductor += 1
        elif event.name.startswith("aten::") and not event.cpu_children \
                and event.name.split("::")[1] not in NO_DATA:
            aten += 1
    return {"profiled_kernels": aten + inductor, "inductor_kernels": inductor}


def cpu_seconds(shape: dict, repeats: int) -> float:
    import torch

    trainer, batch = build(shape, "bfloat16", None)
    trainer.train_step(**batch)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.train_step(**batch)
        best = min(best, time.perf_counter() - started)
    del torch
    return best


def modelled_flops(shape: dict) -> float:
    """FLOPs of one document's step (forward and backward; the frozen head's weight gets no gradient):
    the layers' matmuls over the block rows (and k/v over context + block rows), attention over each
    block's document prefix (half the document on average) and its own block, fc, the head."""
    h, d, heads, kv = shape["hidden"], shape["head_dim"], shape["heads"], shape["kv_heads"]
    q_rows, t = shape["anchors"] * shape["block_size"], shape["tokens"]
    per_layer = (2 * q_rows * (2 * h * heads * d + 3 * h * shape["intermediate"])
                 + 2 * (t + q_rows) * 2 * h * kv * d
                 + 4 * q_rows * heads * d * (t / 2 + shape["block_size"]))
    scored = shape["anchors"] * (shape["block_size"] - 1)
    return 3 * (shape["layers"] * per_layer + 2 * t * 5 * h * h) + 2 * 2 * scored * h * shape["vocab"]


def gpu_row(shape: dict, repeats: int) -> dict:
    import torch

    shape = {**shape, "device": "cuda"}
    trainer, batch = build(shape, "bfloat16", None)
    trainer.train_step(**batch)
    trainer.train_step(**batch)  # the compilations done
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.train_step(**batch)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    samples = shape["documents"] / best
    peak = 989e12  # H100 / H200 dense bf16
    return {"step_s": round(best, 3), "samples_per_s": round(samples, 2),
            "mfu": round(modelled_flops(shape) * samples / peak, 3),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
            "device_name": torch.cuda.get_device_name()}


def one(job: dict) -> dict:
    sys.path.insert(0, job["tree"])
    import dflash_ops

    here = Path(dflash_ops.__file__).resolve()
    assert here.is_relative_to(Path(job["tree"]).resolve()), here
    import torch

    torch.set_num_threads(job["threads"])
    if job["what"] == "census":
        return census_of(job["shape"], job["as_cuda"])
    if job["what"] == "cpu":
        return {"seconds": cpu_seconds(job["shape"], job["repeats"])}
    if job["what"] == "inductor":
        return inductor_kernels(job["shape"])
    return gpu_row(job["shape"], job["repeats"])


def run_job(job: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.drafter_kernels", "--one", json.dumps(job)],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{job['what']} of {job['tree']}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="also the GPU row at the recipe (needs CUDA)")
    parser.add_argument("--inductor", action="store_true",
                        help="also this tree's step compiled with Inductor on CPU, profiled (minutes)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    with tempfile.TemporaryDirectory(prefix="drafter-kernels-") as work:
        trees = {f"{args.baseline} (before)": str(export_baseline(args.baseline, Path(work))),
                 "this tree": str(ROOT)}
        rows = {}
        for label, tree in trees.items():
            base = dict(tree=tree, threads=args.threads, shape=SCALED, repeats=args.repeats)
            rows[label] = {"cpu": run_job({**base, "what": "census", "as_cuda": False}),
                           "cuda": run_job({**base, "what": "census", "as_cuda": True}),
                           "seconds": run_job({**base, "what": "cpu"})["seconds"]}
            if args.gpu:
                rows[label]["gpu"] = run_job({**base, "shape": RECIPE, "what": "gpu"})
        if args.inductor:
            rows["this tree"]["inductor"] = run_job(dict(tree=str(ROOT), threads=args.threads, shape=SCALED,
                                                         repeats=args.repeats, what="inductor"))
    before, after = rows.values()
    print(f"drafter step at the recipe's width / 8 ({SCALED}), bf16 autocast, dense block mask")
    print("| tree | runs as | kernels a step | kernels a step (profiler) | kernels a layer "
          "| elementwise GB a layer | CPU step s |")
    print("|---|---|---|---|---|---|---|")
    for label, row in rows.items():
        for how in ("cpu", "cuda"):
            c = row[how]
            seconds = f"{row['seconds']:.2f}" if how == "cpu" else ""
            print(f"| {label} | {'as on CPU' if how == 'cpu' else 'as on CUDA'} | {c['kernels']} | "
                  f"{c.get('profiled_kernels', '')} | {c['layer_kernels']:.0f} "
                  f"| {c['layer_bytes'] / 1e9:.3f} | {seconds} |")
    if "inductor" in after:
        c = after["inductor"]
        print(f"| this tree | compiled with Inductor on CPU | | {c['profiled_kernels']} "
              f"({c['inductor_kernels']} Inductor kernels) | | | |")
    for how in ("cpu", "cuda"):
        print(f"after / before, {how}: kernels {after[how]['kernels'] / before[how]['kernels']:.2f}x, "
              f"elementwise bytes a layer {after[how]['layer_bytes'] / before[how]['layer_bytes']:.2f}x")
    print(f"after / before, CPU step time: {after['seconds'] / before['seconds']:.2f}x")
    if args.gpu:
        for label, row in rows.items():
            print(f"GPU {label}: {row['gpu']}")
    print(json.dumps({"shape": SCALED, "rows": rows}))


if __name__ == "__main__":
    main()
