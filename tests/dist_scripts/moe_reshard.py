"""The weight sync's transport with a source rank holding several blocks of one parameter: a Megatron EP x TP
layout of a tiny Qwen3-MoE (the plan's sources, reshard/plan.megatron_blocks) on gloo, every rank holding its
blocks of the same seeded reference tensors. Per rank it runs

  * check_shards and execute (NaN outside what the plan delivers) into the rollout targets given in --plan
    (learnt from vLLM's loaders by the test), comparing what each rollout rank assembles with the reference in
    every block its targets list, and checking the rest is NaN (nothing delivered beyond the targets);
  * verify.gather_whole: every parameter whole on every rollout rank, equal to the reference;
  * engines.hf_writer.write_hf_weights from the same blocks to rank 0, read back from the safetensors files.

Writes OUT/rank{r}.json."""
import argparse
import json
import os

import torch
import torch.distributed as dist


class Blocks:
    """The three weight-out methods of a training engine (engines/base.py) over reference tensors: what
    write_hf_weights reads."""

    def __init__(self, params, sources, full, rank):
        self.params, self.sources, self.full, self.rank = params, sources, full, rank

    def param_shapes(self):
        return self.params

    def source_blocks(self):
        return self.sources

    def weight_shards(self):
        for name, bs in self.sources.items():
            for r, b in bs:
                if r == self.rank:
                    yield name, self.full[name][tuple(slice(o, o + n) for o, n in zip(*b))].clone(), b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from spmdrl.engines.hf_writer import write_hf_weights
    from spmdrl.dist.blocks import megatron_blocks
    from spmdrl.reshard.plan import plan_sync
    from spmdrl.reshard.sync import check_shards
    from spmdrl.reshard.transport import execute, held_shards
    from spmdrl.reshard.verify import gather_whole

    spec = json.load(open(args.plan))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    params = [(n, tuple(s)) for n, s in spec["params"]]
    targets = {n: [(r, (tuple(b[0]), tuple(b[1]))) for r, b in ts] for n, ts in spec["targets"].items()}
    dp, tp, ep = spec["dp"], spec["tp"], spec["ep"]
    grid = [[[d * tp + t for t in range(tp)]] for d in range(dp)]
    sources = megatron_blocks(params, grid, num_layers=spec["layers"], ep=ep)
    plan = plan_sync(params, sources, targets, elem_bytes=4)
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in params}  # the same on every rank
    engine = Blocks(params, sources, full, rank)
    shards = held_shards(engine.weight_shards())
    check_shards(plan, shards, rank)
    res = {"blocks_per_name": {n: len(bs) for n, bs in shards.items()}}

    got = []
    stats = execute(plan, shards, rank, dtype=torch.float32, comm_device=torch.device("cpu"), bucket_bytes=1 << 14,
                    deliver=got.extend, fill=float("nan"))
    bad, outside_not_nan = [], []
    for name, t in got:
        need = torch.zeros(t.shape, dtype=torch.bool)
        for r, (o, n) in targets[name]:
            if r == rank:
                need[tuple(slice(a, a + b) for a, b in zip(o, n))] = True
        if not torch.equal(t[need], full[name][need]):
            bad.append(name)
        if not bool(t[~need].isnan().all()):
            outside_not_nan.append(name)
    res.update(delivered=sorted(n for n, _ in got), bad=bad, outside_not_nan=outside_not_nan,
               bytes_recv=stats.bytes_recv, plan_recv=plan.bytes_recv().get(rank, 0), buckets=stats.buckets)

    whole = gather_whole(plan, [n for n, _ in params], shards, dtype=torch.float32, device=torch.device("cpu"))
    res["whole_equal"] = sorted(n for n, t in whole if torch.equal(t, full[n]))

    out = os.path.join(args.out, "export")
    write_hf_weights(engine, out, 0, rank, dtype=torch.float32, comm_device=torch.device("cpu"), bucket_bytes=1 << 14)
    if rank == 0:
        from safetensors.torch import load_file

        written = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                written.update(load_file(os.path.join(out, f)))
        res["export_equal"] = sorted(n for n, t in written.items() if torch.equal(t, full[n]))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
