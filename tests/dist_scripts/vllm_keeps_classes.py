"""One plain process: a transformers model built before an in-process vLLM engine, the engine (OLMo 2, which vLLM
0.32 serves through its Transformers modeling backend), and a model built after it. Writes OUT/result.json."""
import json
import os
import sys

import torch


def _served(worker):
    model = worker.model_runner.get_model()
    decorated = [m for m in model.modules() if any(c.__name__ == "TorchCompileWithNoGuardsWrapper" for c in type(m).__mro__)]
    return type(model).__name__, [f"{type(m).__module__}.{type(m).__name__}" for m in decorated]


def main(model_dir: str, out: str) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from spmdrl.rollout.vllm_engine import VLLMEngine

    ids = torch.tensor([[5, 9, 30, 44, 12, 7, 81, 100]])
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = before(input_ids=ids).logits[0]
    decoder = type(before.model)
    bases, attrs = decoder.__bases__, dict(vars(decoder))
    engine = VLLMEngine(model_dir, max_model_len=64, seed=0, kv_cache_gb=0.25, max_num_seqs=4)
    served = engine.llm.collective_rpc(_served)[0]  # vLLM's model class, and whether it carries the decorator
    changed = sorted(k for k in set(vars(decoder)) | set(attrs) if vars(decoder).get(k) is not attrs.get(k))
    result = {"served": served[0], "decorated_copy": served[1], "bases_kept": decoder.__bases__ == bases, "changed": changed}
    try:
        with torch.no_grad():
            result["before_diff"] = float((before(input_ids=ids).logits[0] - logits).abs().max())
    except Exception as e:  # the crash this guards against
        result["before_error"] = f"{type(e).__name__}: {e}"
    after = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        result["after_diff"] = float((after(input_ids=ids).logits[0] - logits).abs().max())
    result["after_type"] = type(after.model).__module__
    # vLLM still serves with its own (decorated) copy: prompt log-probs equal transformers'
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=ids[0].tolist())],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lp = torch.log_softmax(logits.double(), -1)
    result["vllm_diff"] = max(abs(next(iter(outs[0].prompt_logprobs[i].values())).logprob - float(lp[i - 1, ids[0, i]]))
                              for i in range(1, ids.shape[1]))
    engine.close()
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
