"""Sequence parallelism on 4 ranks (gloo): what each layout computes, saved by rank 0 for the test to compare.
python -m torch.distributed.run --nproc-per-node 4 sequence_parallel.py MODEL OUT

float64: the tiny model in float64 with spmdrl's attention; on the sp = 2 x dp = 2 and sp = 4 meshes each rank
runs the backbone on its tokens (SequenceShard), log-probs, entropy and a critic-style value (a fixed linear
head on the hidden states) of its response tokens in float64, gathered over sp; then the gradient of a
weighted sum of them, summed over the sp group. Packed and padded batches; the packed row's split points fall
inside sequences.

engine: FSDPEngine (float32) at dp = 4 (sp = 1), sp = 2 x dp = 2 and sp = 4: log-probs and entropy of the same
batch, a critic's values, and one actor update's full gradient (the optimizer step replaced by a recorder) with
padded micro-batches and with packed token-budget micro-batches.
"""
import sys

import torch
import torch.distributed as dist

from spmdrl.algos import POLICY_LOSSES
from spmdrl.batch import Batch
from spmdrl.config import PlacementConfig, load_config
from spmdrl.dist.layout import plan_layout
from spmdrl.dist.meshes import RoleMeshes
from spmdrl.engines.attention import register_hf
from spmdrl.engines.fsdp import FSDPEngine, _backbone_hidden
from spmdrl.engines.response_index import ResponseIndex
from spmdrl.engines.sequence_parallel import SequenceShard
from spmdrl.engines.token_batch import pack_sequences
from spmdrl.loop.update import ActorObjective, run_updates

N = 16  # samples of the global batch


def global_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(3, 13, (N,), generator=g)
    rlen = torch.randint(1, 41, (N,), generator=g)
    P, R = int(plen.max()), int(rlen.max())
    mask = (torch.arange(R)[None] < rlen[:, None]).float()
    return Batch({
        "prompts": torch.randint(3, 300, (N, P), generator=g), "prompt_len": plen,
        "responses": torch.randint(3, 300, (N, R), generator=g) * mask.long(), "response_len": rlen,
        "response_mask": mask, "advantages": torch.randn(N, R, generator=g) * mask, "rollout_log_probs": torch.zeros(N, R),
    })


def sequences(b: Batch, rows):
    prompts = [b["prompts"][i, : int(b["prompt_len"][i])] for i in rows]
    resps = [b["responses"][i, : int(b["response_len"][i])] for i in rows]
    return prompts, resps


def meshes(sp: int):
    return RoleMeshes(plan_layout(PlacementConfig(actor_sp=sp), 4), dist.get_rank(), "cpu")["actor"]


def float64_heads(model, value_w, tb, mesh):
    """(logp, entropy, values) [B, R] in float64 on this rank's tokens, gathered over sp."""
    shard = SequenceShard.of(tb, mesh)
    index = shard.local_index(ResponseIndex.of(tb, batch_first=True), tb.input_ids.shape[1])
    hidden, _ = _backbone_hidden(model, tb, shard)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.hidden)
    logp_all = torch.log_softmax(model.lm_head(h), -1)
    logp = logp_all.gather(-1, index.labels[:, None])[:, 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return tuple(shard.gather(index.scatter(x)) for x in (logp, ent, h @ value_w))


def main():
    model_path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    b = global_batch()
    result = {"float64": {}, "engine": {}}

    # ---- float64, every rank on the whole batch ----------------------------------------------------------
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, attn_implementation=register_hf())
    value_w = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = torch.randn(3, N, b["responses"].shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for sp in (2, 4):
        mesh = meshes(sp)
        for packed in (True, False):
            tb = pack_sequences(*sequences(b, range(N)), 0, packed=packed)
            if packed and rank == 0:  # boundaries inside and across the split: some sequence spans a split point
                width = mesh.sp_padded(tb.input_ids.shape[1])
                cuts = [width * k // sp for k in range(1, sp)]
                cu = tb.cu_seqlens.tolist()
                assert any(a < c < e for c in cuts for a, e in zip(cu, cu[1:])), (cuts, cu)
            model.zero_grad(set_to_none=True)
            heads = float64_heads(model, value_w, tb, mesh)
            R = heads[0].shape[1]
            sum(((w[:, :R] * x).sum() for w, x in zip(weights, heads))).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            for g in grads.values():
                dist.all_reduce(g, group=mesh.group("sp"))
            result["float64"][(sp, packed)] = dict(heads=[x.detach() for x in heads], grads=grads)

    # ---- FSDPEngine, float32 --------------------------------------------------------------------------------
    cfg = load_config(None, [f"model.path={model_path}", "actor.grad_clip=0", "actor.loss_agg_mode=token-mean"])
    body = ActorObjective(cfg, POLICY_LOSSES.get("ppo"), 1.0)
    for sp in (1, 2, 4):
        mesh = meshes(sp)
        eng = FSDPEngine(model_path, mesh, torch.device("cpu"), trainable=True, optim=dict(lr=1e-3, grad_clip=0.0))
        torch.manual_seed(0)  # the critic's fresh value head: the same in every layout
        critic = FSDPEngine(model_path, mesh, torch.device("cpu"), trainable=False, value_head=True)
        recorded = {}
        eng.optimizer.step = lambda *a, **k: recorded.update(
            {n: p.grad.full_tensor().clone() for n, p in eng.hf.named_parameters() if p.grad is not None})
        per = N // mesh.dp_size
        rows = list(range(mesh.dp_rank * per, (mesh.dp_rank + 1) * per))  # this replica's samples
        res = {}
        with torch.no_grad():
            tb = pack_sequences(*sequences(b, range(N)), 0, packed=True)
            res["logp"], res["entropy"] = eng.logprobs(tb, with_entropy=True)
            res["values"] = critic.values(pack_sequences(*sequences(b, range(N)), 0, packed=False))
        for name, micro, budget, packed in (("padded", 8, 0, False), ("packed_budget", per, 60, True)):
            recorded.clear()
            run_updates(eng, b.select(rows), epochs=1, mini_size=per, micro_size=min(micro, per), pad_id=0,
                        dp_size=mesh.dp_size, dp_group=mesh.group("dp"), objective=body, prefix="actor",
                        max_tokens=budget, packed=packed)
            res[name] = dict(recorded)
        result["engine"][sp] = res
        del eng, critic
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
