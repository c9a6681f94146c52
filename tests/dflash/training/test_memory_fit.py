"""The memory-fit check of `python -m dflash_ops.config validate`: each rank's predicted peak against the
GPUs the config gets, offline (`--gpu-memory`) and from nvidia-smi (a fake one on PATH, as the
container's driver would answer), refused with the per-term figures and the knob to turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.core.config import load_config
from dflash_ops.training import memory_fit

REPO = Path(__file__).resolve().parents[3]
# Qwen3-8B's config.json, the fields the trainer reads (no weights: validate reads only the shape).
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


@pytest.fixture
def recipe(tmp_path):
    """Factory: the paper's recipe on the product's 5 + 3 GPU layout, `model`/`data` keys updated."""
    target = tmp_path / "qwen3-8b"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(QWEN3_8B))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(40)), "loss_mask": [0] * 8 + [1] * 32}) + "\n")

    def make(model=None, data_keys=None, pipeline=None) -> Path:
        raw = {
            "model": {"target_path": str(target), "num_draft_layers": 5, "block_size": 16,
                      "dtype": "bfloat16", "loss_chunk_size": 512, **(model or {})},
            "data": {"path": str(data), "max_length": 3072, "batch_size": 8, "max_anchors": 512,
                     **(data_keys or {})},
            "run": {"output_dir": str(tmp_path / "run")},
            "pipeline": {"device": "cuda", "target_gpus": [0, 1, 2, 3, 4], "drafter_gpus": [5, 6, 7],
                         "queue_depth": 4, **(pipeline or {})},
        }
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    return make


def validate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_ops.config", "validate", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_the_recipe_fits_an_h200_in_one_line(recipe):
    done = validate(recipe(), "--no-target-check", "--gpu-memory", "141GB")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 and "memory fits: target" in done.stdout, done.stdout


def test_unchunked_512_anchors_at_5_layers_is_refused_on_a_48gb_gpu_with_the_knob(recipe):
    """Unchunked, the recipe's drafter rank needs the [scored, vocab] logits term (~12 GiB) on top of
    what the chunked one needs: it fits an 80 GB GPU (docs/SCALE.md) but not a 48 GB one, where the
    chunked loss fits."""
    config = recipe(model={"loss_chunk_size": None})
    assert validate(config, "--no-target-check", "--gpu-memory", "80GB").returncode == 0
    done = validate(config, "--no-target-check", "--gpu-memory", "48GB")
    assert done.returncode == 2, done.stdout
    assert "the drafter rank needs" in done.stderr and "GPU 5 has 44.7 GiB" in done.stderr, done.stderr
    # The key named is the one that turns the largest term a key turns: the logits'.
    assert "model.loss_chunk_size: the predicted peak" in done.stderr
    for term in ("target_head", "drafter_weights_fp32", "adamw_state_fp32", "loss_unchunked",
                 "feature_queue"):
        assert term in done.stderr
    # The same config chunked fits the same GPU: the refusal was the loss term's.
    assert validate(recipe(), "--no-target-check", "--gpu-memory", "48GB").returncode == 0


def test_the_json_refusal_names_the_key_to_turn(recipe):
    """The key is the knob (the release role names the inventory variable that sets it)."""
    done = validate(recipe(model={"loss_chunk_size": None}), "--no-target-check", "--gpu-memory", "48GB",
                    "--json")
    answer = json.loads(done.stdout)
    assert done.returncode == 2 and answer["ok"] is False and answer["key"] == "model.loss_chunk_size"


def test_weights_alone_over_the_gpu_name_the_layout_change_and_json_lists_every_failing_rank(recipe):
    """On 16 GB GPUs the Qwen3-8B target's weights alone do not fit, nor do the drafter's weights, head and
    AdamW state: no batch or chunk knob can help, and the refusal says so for both roles."""
    done = validate(recipe(), "--no-target-check", "--gpu-memory", "16GB")
    assert done.returncode == 2, done.stdout
    assert done.stderr.count("optimizer state alone need") == 2 and "no batch, anchor or chunk" in done.stderr
    assert "data.features_path" in done.stderr and "model.num_draft_layers" in done.stderr
    assert "turn model.target_rows_per_pass" not in done.stderr and "turn data.batch_size" not in done.stderr
    answer = json.loads(validate(recipe(), "--no-target-check", "--gpu-memory", "16GB", "--json").stdout)
    assert answer["key"] == "pipeline"
    failing = {(rank["role"], rank["gpu"]) for rank in answer["failing"]}
    assert failing == {("target", g) for g in range(5)} | {("drafter", g) for g in (5, 6, 7)}
    assert all(rank["fixed_gib"] > rank["has_gib"] for rank in answer["failing"])
    assert {rank["key"] for rank in answer["failing"]} == {"pipeline"}


def test_nvidia_smi_where_validate_runs_gives_the_gpus_memory(recipe, tmp_path):
    """A cuda layout with the machine checks on reads the GPUs from nvidia-smi: 8 GPUs of 46068 MiB
    (a 48 GB GPU) refuse the unchunked recipe; 143771 MiB (an H200) take it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    smi = bin_dir / "nvidia-smi"

    def gpus(mib: int) -> None:
        rows = "".join(f"{i}, {mib}\\n" for i in range(8))
        smi.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nprintf "{rows}"\n')
        smi.chmod(0o755)

    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    config = recipe(model={"loss_chunk_size": None})
    gpus(46068)
    refused = validate(config, env=env)
    assert refused.returncode == 2 and "GPU 5 has 45.0 GiB" in refused.stderr, refused.stderr + refused.stdout
    # `nvidia-smi -q` for the driver's CUDA version (which this fake does not print), then the memory query.
    assert calls.read_text().splitlines() == ["-q",
                                              "--query-gpu=index,memory.total --format=csv,noheader,nounits"]
    gpus(143771)
    taken = validate(config, env=env)
    assert taken.returncode == 0 and "memory fits" in taken.stdout, taken.stderr


def test_no_check_without_a_gpu_to_check_against(recipe, tmp_path):
    """A cpu layout, or cuda where no nvidia-smi answers and no --gpu-memory is given: nothing to check."""
    env = {"PATH": str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin"}
    if any((Path(d) / "nvidia-smi").exists() for d in env["PATH"].split(os.pathsep)):
        pytest.skip("this machine has an nvidia-smi")
    done = validate(recipe(model={"loss_chunk_size": None}), "--no-target-check", env=env)
    assert done.returncode == 0 and "memory" not in done.stdout, done.stdout + done.stderr


def test_the_drafter_parameters_are_the_built_drafters(tmp_path):
    """The arithmetic's parameter count is the real module's (a narrow shape of Qwen3's kind)."""
    from transformers import Qwen3Config

    from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig

    tconf = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(tconf.to_json_string())
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    raw = {"model": {"target_path": str(target), "num_draft_layers": 3}, "data": {"path": str(data)},
           "run": {"output_dir": str(tmp_path / "r")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "c.yaml", check_target=False)
    shape = memory_fit.TargetShape.read(str(target))
    k = len(memory_fit.feature_layer_ids(cfg, shape))
    import torch

    head = torch.nn.Embedding(64, 32)
    drafter = DFlashDrafter(DrafterConfig.from_target_config(tconf, num_layers=3, num_target_features=k,
                                                             block_size=16, mask_token_id=1),
                            head, torch.nn.Linear(32, 64, bias=False))
    trainable = sum(p.numel() for n, p in drafter.named_parameters()
                    if not n.startswith(("embed", "lm_head")))
    assert memory_fit.drafter_parameters(cfg, shape) == trainable


@pytest.mark.parametrize(("text", "size"), [("141GiB", 141 << 30), ("80GB", 80 * 10**9),
                                            ("81559MiB", 81559 << 20), ("96", 96 << 30)])
def test_gpu_memory_sizes(text, size):
    assert memory_fit.parse_gpu_memory(text) == size


def test_an_nvidia_smi_that_fails_is_a_clear_refusal(recipe, tmp_path):
    """A cuda layout where the driver does not answer (nvidia-smi's exit 9): refused, with its words."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho \"NVIDIA-SMI has failed\"\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    done = validate(recipe(), env=env)
    assert done.returncode == 2 and "exit 9: NVIDIA-SMI has failed" in done.stderr, done.stderr


def test_a_bad_gpu_memory_is_refused(recipe):
    done = validate(recipe(), "--no-target-check", "--gpu-memory", "lots")
    assert done.returncode == 2 and "--gpu-memory" in done.stderr


REPORT = """
==============NVSMI LOG==============

Driver Version                        : 550.127.05
CUDA Version                          : 12.4

Attached GPUs                         : 8
"""


def test_a_cpu_torch_on_a_cuda_layout_is_refused_with_the_driver_and_the_wheelhouse(recipe, tmp_path):
    """nvidia-smi -q says driver 550 (CUDA 12.4); this venv's torch is the CPU wheel: validate refuses the
    cuda layout at pipeline.device (the release role names dflash_release_device), before any worker."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this venv's torch is a CUDA build")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    rows = "".join(f"{i}, 143771\\n" for i in range(8))
    (bin_dir / "report").write_text(REPORT)
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\nif [ "$1" = -q ]; then cat {bin_dir}/report; '
                                        f'else printf "{rows}"; fi\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    done = validate(recipe(), "--json", env=env)
    answer = json.loads(done.stdout)
    assert done.returncode == 2 and answer["key"] == "pipeline.device", done.stdout + done.stderr
    assert (f"torch {torch.__version__} in the venv is a CPU build" in answer["message"]
            and "the driver 550.127.05 supports CUDA 12.4" in answer["message"]
            and "wheel of CUDA 12.x in the wheelhouse" in answer["message"]), answer["message"]
    # The machine checks off (an offline validate): nothing of the driver is read.
    assert validate(recipe(), "--no-target-check", env=env).returncode == 0


def test_a_gpu_rank_counts_nccl_the_optimizer_s_temporaries_and_the_allocator_s_reserve(recipe):
    """On CUDA: NCCL's buffers per communicator and peer (from NCCL's defaults), AdamW's foreach temporary
    (the parameters again in fp32) and the caching allocator's reserve over what torch allocates; none of
    them on CPU, where the rehearsal measures the whole process."""
    cfg = load_config(recipe(pipeline={"target_gpus": [0, 1, 2], "drafter_gpus": [3, 4, 5, 6, 7]}),
                      check_target=False)
    shape = memory_fit.TargetShape.read(cfg.model.target_path)
    target, drafter = (dict(p.terms) for p in memory_fit.predict(cfg, shape))
    connection = (4 << 20) + (512 << 10) + 120 * 640 * 8 * 8  # SIMPLE, LL, LL128 of one channel
    collective = 2 * 32 * connection  # a ring and a tree connection on each of 32 channels
    peer = 8 * 8 * (512 << 10)  # 8 channels of 8 steps of 512 KiB
    assert target["nccl_buffers"] == collective + 5 * peer  # the startup group; 5 drafters
    assert drafter["nccl_buffers"] == 2 * collective + 3 * peer  # and the drafters' all-reduce; 3 targets
    assert round(drafter["nccl_buffers"] / memory_fit.MiB) == 1272
    params = memory_fit.drafter_parameters(cfg, shape)
    assert drafter["adamw_temporaries"] == 4 * params == drafter["drafter_weights_fp32"]
    for terms in (target, drafter):
        outside = ("runtime", "nccl_buffers", "allocator_reserve")
        allocated = sum(b for n, b in terms.items() if n not in outside)
        assert terms["allocator_reserve"] == int(0.03 * allocated)
    on_cpu = load_config(recipe(pipeline={"device": "cpu", "target_gpus": [], "drafter_gpus": [],
                                          "target_workers": 3, "drafter_workers": 5}), check_target=False)
    for peak in memory_fit.predict(on_cpu, shape, runtime_bytes=0):
        terms = dict(peak.terms)
        assert terms["nccl_buffers"] == terms["allocator_reserve"] == terms.get("adamw_temporaries", 0) == 0
