"""LoRA weight sync into real vLLM under torchrun (2 ranks, gloo); each rank writes OUT/rank{r}.json.

Phases, one vLLM build each:
  adapter: LoRA engine, TP=2 (colocated): sync adapter v1, compare with the PEFT actor; one "optimizer step" on
           the adapter, sync v2, compare; load a PEFT save_pretrained export through a LoRARequest, compare.
  split:   LoRA engine on rank 0 only (world_ranks=1), rank 1 is the actor: the adapter crosses ranks.
  merge:   engine without LoRA, TP=2: the adapter merged into the base goes through the planned full-weight sync.
The actor here is a PEFT model each rank holds whole (the training engine's adapter interface over a local
model): adapter_tensors / adapter_config / weight_shards, what the FSDP2 LoRA engine provides.

python -m torch.distributed.run --nproc-per-node 2 vllm_lora_sync.py --model M --out DIR
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from spmdrl.reshard.adapter import AdapterSync, MergedActor, adapter_params
from spmdrl.dist.blocks import full_block
from spmdrl.reshard.sync import WeightSync
from spmdrl.rollout.vllm_engine import LoRASpec, VLLMEngine

RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [100, 7, 200, 9, 31, 64, 3]]
RESPONSES = [[11, 12, 13, 40, 50], [60, 61, 62, 63], [70, 71]]


class LocalPeftActor:
    """A PEFT model held whole on every rank, exposing the training engine's adapter interface."""

    def __init__(self, model_path: str, world: int):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # the same adapter on every rank
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.pm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))
        self.pm.eval()
        self.step(1)
        self.world = world

    @torch.no_grad()
    def step(self, seed: int) -> None:
        """Stand-in for an optimizer step: new lora_A and lora_B (B nonzero, so the adapter matters)."""
        g = torch.Generator().manual_seed(seed)
        for n, p in self.pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def adapter_tensors(self, dtype=None):
        from peft import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.pm)
        return [(n, t.detach().to(dtype or t.dtype).clone()) for n, t in sd.items()]

    def adapter_config(self) -> dict:
        d = self.pm.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in d.items()}

    def hf_config(self):
        return self.pm.base_model.model.config

    def _base(self):
        for n, p in self.pm.named_parameters():
            if "lora_" not in n:
                yield n.replace("base_model.model.", "", 1).replace(".base_layer", ""), p

    def param_shapes(self):
        return [(n, tuple(p.shape)) for n, p in self._base()]

    def source_blocks(self):
        return {n: [(r, full_block(tuple(p.shape))) for r in range(self.world)] for n, p in self._base()}

    def weight_shards(self, dtype=None):
        for n, p in self._base():
            yield n, p.detach(), full_block(tuple(p.shape))

    @torch.no_grad()
    def logprobs(self, prompt, response, adapter=True):
        ids = torch.tensor([prompt + response])
        if adapter:
            logits = self.pm(input_ids=ids).logits
        else:
            with self.pm.disable_adapter():
                logits = self.pm(input_ids=ids).logits
        lp = torch.log_softmax(logits[0, len(prompt) - 1: -1].double(), -1)
        return lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def max_diff(eng, actor, lora_request=None):
    if lora_request is None:
        got = eng.compute_logprobs(PROMPTS, RESPONSES)
    else:  # a request of our own (the exported adapter), through vLLM's public generate
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = eng.llm.generate([TokensPrompt(prompt_token_ids=p + r) for p, r in zip(PROMPTS, RESPONSES)], params,
                                use_tqdm=False, lora_request=lora_request)
        got = [[o.prompt_logprobs[len(p) + k][t].logprob for k, t in enumerate(r)]
               for o, p, r in zip(outs, PROMPTS, RESPONSES)]
    want = [actor.logprobs(p, r) for p, r in zip(PROMPTS, RESPONSES)]
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))


def sampled_diff(eng, actor):
    """Log-probs vLLM returns for the tokens it samples (temperature 1) against the actor's."""
    from spmdrl.rollout import SamplingSpec

    out = eng.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_tokens=6), seeds=[1, 2, 3])
    prompts = [p for p in PROMPTS for _ in range(2)]
    want = [actor.logprobs(p, r) for p, r in zip(prompts, out.response_ids)]
    return max(abs(a - b) for g, w in zip(out.logprobs, want) for a, b in zip(g, w))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    actor = LocalPeftActor(args.model, world)
    res = {"rank": rank}
    params = adapter_params(actor.hf_config(), RANK, TARGETS)
    res["adapter_bytes"] = sum(p.numel() * 4 for n, p in actor.pm.named_parameters() if "lora_" in n)
    res["planned_adapter_bytes"] = sum(a * b for _, (a, b) in params) * 4

    # ---- adapter sync, colocated, TP=2
    eng = VLLMEngine(args.model, tp_size=2, max_model_len=128, seed=0, lora=LoRASpec(rank=RANK))
    res["base_diff"] = max_diff(eng, _Base(actor))
    sync = AdapterSync(actor, eng, params=params, config=actor.adapter_config(), dtype=torch.float32, bucket_mb=1,
                       rollout_ranks=[0, 1], actor_grid=[[[0]], [[1]]])  # the figures of an FSDP2 actor over dp=2
    res["v1_metrics"] = sync()
    res["v1_diff"] = max_diff(eng, actor)
    res["v1_sampled_diff"] = sampled_diff(eng, actor)
    res["v1_dir"] = eng.adapter_request.lora_path
    actor.step(2)
    res["stale_diff"] = max_diff(eng, actor)  # the engine still serves v1: must differ from the new actor
    t0 = time.perf_counter()
    res["v2_metrics"] = sync()
    res["v2_sync_s"] = time.perf_counter() - t0
    res["v2_diff"] = max_diff(eng, actor)
    res["version"] = eng.adapter_version
    res["v1_dir_exists"] = os.path.exists(res["v1_dir"])
    res["loaded_ids"] = sorted(eng.llm.llm_engine.list_loras())
    # the PEFT export (adapter_config.json + adapter_model.safetensors) loads through a LoRARequest
    from vllm.lora.request import LoRARequest

    export = os.path.join(args.out, f"export{rank}")
    actor.pm.save_pretrained(export)
    res["export_files"] = sorted(os.listdir(export))
    res["export_diff"] = max_diff(eng, actor, LoRARequest("exported", 1000, export))
    home = eng._adapter_home
    eng.close()
    res["home_removed"] = not os.path.exists(home)
    dist.barrier()

    # ---- adapter sync, split placement: rank 0 serves, rank 1 trains and sends
    actor.step(3)
    eng = VLLMEngine(args.model, tp_size=1, max_model_len=128, seed=0, lora=LoRASpec(rank=RANK),
                     world_ranks=1) if rank == 0 else None
    sync = AdapterSync(actor if rank == 1 else None, eng, params=params, config=actor.adapter_config(),
                       dtype=torch.float32, bucket_mb=1, rollout_ranks=[0], split=True, source=1)
    res["split_metrics"] = sync()
    if eng is not None:
        res["split_diff"] = max_diff(eng, actor)
        eng.close()
    dist.barrier()

    # ---- merge: no LoRA in vLLM; merged weights through the planned full-weight sync
    eng = VLLMEngine(args.model, tp_size=2, max_model_len=128, seed=0)
    ws = WeightSync(MergedActor(actor), eng, _Mesh([[0, 1]]), dtype=torch.float32, bucket_mb=1)
    res["merge_metrics"] = ws()
    res["merge_diff"] = max_diff(eng, actor)
    eng.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


class _Base:
    """The actor with its adapter disabled (what vLLM serves before the first adapter sync)."""

    def __init__(self, actor):
        self.actor = actor

    def logprobs(self, prompt, response):
        return self.actor.logprobs(prompt, response, adapter=False)


class _Mesh:
    """The rollout layout WeightSync plans for: its TP groups."""

    def __init__(self, groups):
        self.groups = groups

    def tp_groups(self):
        return self.groups


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
