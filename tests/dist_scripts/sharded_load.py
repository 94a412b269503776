"""Sharded loading on 2 ranks: RSS growth of loading a few-hundred-million-parameter model vs the plan, and
log-probs of a tiny model loaded sharded (dp=2, then tp=2) vs the unsharded transformers model.
Writes <out>/load_rank{r}.json."""
import argparse
import gc
import json
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--big", required=True)
    p.add_argument("--tiny", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from spmdrl.config import Config
    from spmdrl.dist.init import init_distributed
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.loop.memory import host_rss_bytes
    from spmdrl.models.model import model_param_shapes
    from spmdrl.plan import load_bytes_per_rank

    env, device = init_distributed("cpu")
    torch.manual_seed(0)
    meshes = RoleMeshes(plan_layout(Config().placement, 2), env.rank, "cpu")
    params = model_param_shapes(AutoConfig.from_pretrained(args.big))
    planned = load_bytes_per_rank(params, meshes["actor"].layout, store_eb=4, ckpt_eb=2)
    full_fp32 = sum(torch.Size(s).numel() for _, s in params) * 4
    torch.distributed.barrier()
    gc.collect()
    before = host_rss_bytes()
    big = build_train_engine("fsdp", args.big, meshes["actor"], device, trainable=True, optim={})
    gc.collect()
    growth = host_rss_bytes() - before
    held = sum(t.numel() * t.element_size() for _, t, _ in big.weight_shards())
    del big
    gc.collect()

    # log-probs after sharded loading vs the unsharded transformers model, fp32
    ref = AutoModelForCausalLM.from_pretrained(args.tiny, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=g) for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 60, (n,), generator=g) for n in (6, 2, 8, 4)]
    tb = pack_sequences(prompts, responses, pad_id=0)
    with torch.no_grad():
        logits = ref(input_ids=tb.input_ids, attention_mask=tb.attention_mask, position_ids=tb.position_ids).logits
        lp_all = torch.log_softmax(logits.double(), -1)
        want = lp_all[torch.arange(4)[:, None], tb.resp_pos].gather(-1, tb.resp_ids[..., None])[..., 0] * tb.resp_mask
    diffs = {}
    for tp in (1, 2):
        placement = Config().placement
        placement.actor_tp = tp
        mesh = RoleMeshes(plan_layout(placement, 2), env.rank, "cpu")["actor"]
        eng = build_train_engine("fsdp", args.tiny, mesh, device, trainable=True, optim={})
        eng.eval()
        with torch.no_grad():
            got, _ = eng.logprobs(tb)
            # packed: one row with cu_seqlens through the varlen attention, each rank on its local heads (GQA)
            got_packed, _ = eng.logprobs(pack_sequences(prompts, responses, pad_id=0, packed=True))
        diffs[f"tp{tp}"] = float((got.double() - want).abs().max())
        diffs[f"tp{tp}-packed"] = float((got_packed.double() - want).abs().max())
    with open(os.path.join(args.out, f"load_rank{env.rank}.json"), "w") as f:
        json.dump({"rss_growth": growth, "planned": planned, "full_fp32": full_fp32, "held": held,
                   "logprob_diff": diffs}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
