"""Load an export the way the serving side does, with whatever transformers this Python has.

    python export_compat_check.py EXPORT_DIR TARGET_DIR INPUTS.safetensors OUT_DIR

Run by tests/dflash/serve/test_export_compat.py under the project's transformers and under the one the
public DFlash code pins (4.57.1, in the venv of `make compat-venv`). It imports nothing of this
project: only the export directory, transformers and torch. It writes OUT_DIR/result.json (the
transformers version, the loading info of `AutoModel.from_pretrained(EXPORT_DIR,
trust_remote_code=True)`, the class it built, the config's RoPE base, layer types and sliding
window) and OUT_DIR/result.safetensors:
`public_inv_freq` (transformers' own Qwen3RotaryEmbedding of the exported config, what the public
code builds) and, when it built the drafter, `model_inv_freq` (the loaded model's) and `logits` (the
block's, through the target's lm_head given in INPUTS), and `spec_generate` / `greedy`: the
public code's `draft.spec_generate(...)` call and the target's own greedy `generate` on INPUTS'
`prompt`, both ending at INPUTS' `stop_token_id`.
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding


def main(export_dir: str, target_dir: str, inputs_path: str, out_dir: str) -> int:
    torch.set_num_threads(1)  # the same reduction order as the reference computed in the test
    inputs = load_file(inputs_path)
    config = AutoConfig.from_pretrained(export_dir)
    public_inv_freq = Qwen3RotaryEmbedding(config).inv_freq
    model, info = AutoModel.from_pretrained(export_dir, trust_remote_code=True, output_loading_info=True)
    result = {
        "transformers": transformers.__version__,
        "class": type(model).__name__,
        "loaded_dtype": str(next(model.parameters()).dtype),
        "rope_theta": getattr(config, "rope_theta", None),  # transformers 4's attribute (5 has none)
        # What this transformers' Qwen3Config kept of the layers' attention.
        "layer_types": {"layer_types": config.layer_types, "sliding_window": config.sliding_window},
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": sorted(str(k) for k in info.get("mismatched_keys", [])),
        "parameters": sorted(name for name, _ in model.named_parameters()),
    }
    out = Path(out_dir)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    tensors = {"public_inv_freq": public_inv_freq.float().contiguous()}
    if hasattr(model, "draft_hidden"):  # the drafter, not a stand-in that transformers built without auto_map
        model = model.float().eval()  # bf16 -> fp32 is exact: the reference runs these weights in fp32
        with torch.no_grad():
            hidden = model(inputs["target_hidden"], inputs["noise_embedding"], inputs["position_ids"],
                           attention_mask=inputs["attention_mask"])
        tensors["logits"] = torch.nn.functional.linear(hidden[0], inputs["lm_head"]).contiguous()
        tensors["model_inv_freq"] = model.inv_freq.float().contiguous()
        target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        prompt, stop = inputs["prompt"][None], int(inputs["stop_token_id"])
        with torch.no_grad():
            tensors["greedy"] = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                                do_sample=False, max_new_tokens=24, eos_token_id=stop,
                                                pad_token_id=stop)[0].contiguous()
        tensors["spec_generate"] = model.spec_generate(input_ids=prompt, max_new_tokens=24, temperature=0.0,
                                                       target=target, stop_token_ids=[stop])[0].contiguous()
    save_file(tensors, str(out / "result.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
