"""vLLM's own DSpark code on a DSpark export: its loader, its Markov and confidence heads, its drafting loop.

    <serve venv>/bin/python benchmarks/vllm_dspark_driver.py REQUEST.json RESULT.json

Runs in the venv of `make serve-check` (scripts/serve_venv.py) and imports nothing of this project. vLLM's
engine does not serve DSpark on CPU: `VllmConfig` refuses it on the V1 model runner ("Model Runner V1 does
not support: dspark speculative decoding"), and the V2 runner, the one with a DSpark speculator
(vllm/v1/worker/gpu/spec_decode/dspark/speculator.py), needs Triton. So this driver lifts that one check
(`VllmConfig._validate_v1_model_runner`) and drives vLLM's parts directly, on CPU:

- the config: `EngineArgs(..., speculative_config={"method": "dspark", ...}).create_engine_config()`, whose
  `SpeculativeConfig` reads the export's config.json as a serving user's would;
- the weights: `load_dspark_model(target_model, vllm_config)`
  (vllm/v1/worker/gpu/spec_decode/dspark/utils.py), the function the DSpark speculator loads its drafter
  with: `get_model` builds `Qwen3DSparkForCausalLM`, its `load_weights` maps and loads the export (any
  name it has no parameter for raises), and the target's embedding and lm_head are shared into it.
  `Qwen3DSparkForCausalLM.load_weights` returns nothing, so the loader's own "weights not initialized
  from checkpoint" check never runs for DSpark: the driver records what `AutoWeightsLoader.load_weights`
  loaded and reports every parameter it did not load;
- the heads: `compute_draft_logits(h) + markov_bias(markov_embed(prev))` and `compute_confidence` on given
  hidden states and previous tokens;
- the drafting: `DSparkSpeculator._sample_sequential` itself (greedy: the engine's `draft_logits` is None at
  temperature 0), over given backbone outputs and anchor tokens, on a namespace that holds the speculator's
  buffers: the draft tokens and confidences it writes.

REQUEST.json: `{"target": DIR, "drafter": DIR, "num_speculative_tokens": N, "dtype": "float32",
"max_model_len": L, "inputs": FILE, "result_tensors": OUT}`; FILE (safetensors): `head_hidden`
`[R * N, hidden]` (each request's N block positions' backbone outputs), `anchors` `[R]`, `probe_hidden`
`[M, hidden]`, `probe_prev` `[M]`.
RESULT.json: the model's class, its parameters, those loaded and those not, which are the target's, and the
path of a safetensors file with `draft_tokens` `[R, N]`, `draft_confidence` `[R, N]`, `probe_logits`
`[M, vocab]` and `probe_confidence` `[M]`.
"""

import json
import socket
import sys
import types


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load(request: dict):
    """The config, the target model, vLLM's DSpark drafter loaded by its own loader, and the names its
    `load_weights` loaded."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models import utils as model_utils
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    VllmConfig._validate_v1_model_runner = lambda self: None  # the one check lifted: see the docstring
    args = EngineArgs(model=request["target"], dtype=request["dtype"], max_model_len=request["max_model_len"],
                      enforce_eager=True, seed=0,
                      speculative_config={"method": "dspark", "model": request["drafter"],
                                          "num_speculative_tokens": request["num_speculative_tokens"]})
    config = args.create_engine_config()
    _set_torch_accelerator_to_noop()  # as vLLM's CPU worker does before it loads a model
    loaded: list[set] = []
    autoload = model_utils.AutoWeightsLoader.load_weights

    def recording(self, *a, **kw):
        names = autoload(self, *a, **kw)
        loaded.append(set(names))
        return names

    model_utils.AutoWeightsLoader.load_weights = recording
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)
        target = get_model(vllm_config=config)
        loaded.clear()  # the target's own loading
        draft = load_dspark_model(target, config)
    model_utils.AutoWeightsLoader.load_weights = autoload
    return config, target, draft, loaded[-1]  # the outermost call (the model's), which returns last


def shared_with_target(draft, target) -> list[str]:
    """The drafter's parameters that are the target's own tensors (shared, not loaded from the export)."""
    ours = {id(p) for p in target.parameters()}
    return sorted(name for name, p in draft.named_parameters() if id(p) in ours)


def draft_greedily(draft, head_hidden, anchors, n_spec: int) -> tuple:
    """`DSparkSpeculator._sample_sequential` over `head_hidden` (`[R * n_spec, hidden]`) and `anchors`: the
    draft tokens and the confidence head's probabilities it writes, `[R, n_spec]` each."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    reqs = anchors.shape[0]
    # The speculator's buffers as `propose` leaves them before sampling: query block i of request r at
    # rows r * n_spec + i; the anchor (input id at query offset 0) at rows r * n_spec.
    state = types.SimpleNamespace(
        num_speculative_steps=n_spec, model=draft, _draft_topk=None, draft_logits=None,
        acceptance_estimator=None,
        use_confidence_head=draft.model.confidence_head is not None,
        sample_indices=torch.arange(reqs * n_spec), sample_idx_mapping=torch.arange(reqs * n_spec),
        sample_pos=torch.arange(reqs * n_spec) + 1,
        input_buffers=types.SimpleNamespace(input_ids=torch.zeros(reqs * n_spec, dtype=torch.long)
                                            .index_put_((torch.arange(reqs) * n_spec,), anchors)),
        _anchor_idx=torch.arange(reqs) * n_spec, _step_cols=torch.arange(n_spec),
        draft_tokens=torch.zeros(reqs, n_spec, dtype=torch.long),
        draft_token_confidence_probs=torch.full((reqs, n_spec), float("nan")))
    state._sample_logits = lambda *a: DSparkSpeculator._sample_logits(state, *a)
    state._maybe_predict_acceptance = lambda *a: DSparkSpeculator._maybe_predict_acceptance(state, *a)
    DSparkSpeculator._sample_sequential(state, reqs, head_hidden)
    return state.draft_tokens, state.draft_token_confidence_probs


def run(request: dict) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    config, target, draft, loaded = load(request)
    inputs = load_file(request["inputs"])
    params = sorted(name for name, _ in draft.named_parameters())
    shared = shared_with_target(draft, target)
    n_spec = config.speculative_config.num_speculative_tokens
    with torch.no_grad():
        dtype = draft.lm_head.weight.dtype
        hidden = inputs["probe_hidden"].to(dtype)
        embed = draft.markov_embed(inputs["probe_prev"])
        logits = draft.compute_draft_logits(hidden) + draft.markov_bias(embed)
        confidence = (draft.compute_confidence(hidden, embed) if draft.model.confidence_head is not None
                      else torch.full((hidden.shape[0],), float("nan")))
        tokens, token_confidence = draft_greedily(draft, inputs["head_hidden"].to(dtype), inputs["anchors"],
                                                  n_spec)
    outputs = request["result_tensors"]
    save_file({"draft_tokens": tokens.contiguous(), "draft_confidence": token_confidence.float().contiguous(),
               "probe_logits": logits.float().contiguous(),
               "probe_confidence": confidence.float().contiguous()}, outputs)
    return {"class": type(draft).__name__, "method": config.speculative_config.method, "parameters": params,
            "loaded": sorted(loaded), "not_loaded": sorted(set(params) - loaded - set(shared)),
            "shared_with_target": shared, "num_speculative_tokens": n_spec, "tensors": outputs,
            "confidence_head": draft.model.confidence_head is not None}


if __name__ == "__main__":
    request_path, result_path = sys.argv[1:3]
    with open(request_path) as fh:
        result = run(json.load(fh))
    with open(result_path, "w") as fh:
        json.dump(result, fh)
