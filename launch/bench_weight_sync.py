"""Weight-sync benchmark: the planned resharding against the full gather it replaced, side by side.

    torchrun --nproc-per-node 2 launch/bench_weight_sync.py --actor-tp 1 --rollout-tp 2 [--hidden 512 --layers 8]

Builds one FSDP2 actor and one in-process vLLM engine on the layout, then alternates, --repeats times:
  * full gather (spmdrl before the reshard planner): every parameter all-gathered to full size on every
    rank (`DTensor.full_tensor`, one collective per parameter), cast, streamed into vLLM in buckets;
  * planned: `spmdrl.reshard.sync.WeightSync` (each rank receives only the missing bytes of its shard).
Rank 0 prints the median seconds of each and the bytes each rank received (max over ranks).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def full_gather_sync(actor, rollout, dtype, bucket_bytes):
    """The pre-plan weight sync, for comparison: returns the bytes this rank received."""
    rollout.wake_up()
    bucket, size, recv = [], 0, 0
    for name, p in actor.hf.named_parameters():
        if isinstance(p, DTensor):
            recv += (p.numel() - p.to_local().numel()) * p.element_size()
            t = p.full_tensor()
        else:
            t = p
        bucket.append((name, t.detach().to(dtype)))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            rollout.update_weights(bucket)
            bucket, size = [], 0
    if bucket:
        rollout.update_weights(bucket)
    rollout.finish_weight_update()
    return recv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--actor-tp", type=int, default=1)
    ap.add_argument("--rollout-tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--work-dir", default="outputs/bench_weight_sync")
    args = ap.parse_args()

    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine
    from spmdrl.reshard.sync import WeightSync
    from spmdrl.rollout import build_engine
    from spmdrl.tiny import build_tiny

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = f"{args.work_dir}/model_h{args.hidden}_l{args.layers}"
    if rank == 0:
        build_tiny(model, seed=0, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 32,
                   num_kv_heads=max(1, args.hidden // 64), intermediate_size=3 * args.hidden)
    dist.barrier()
    layout = plan_layout(PlacementConfig(actor_tp=args.actor_tp, rollout_tp=args.rollout_tp), world)
    meshes = RoleMeshes(layout, rank, "cpu")
    actor = build_train_engine("fsdp", model, meshes["actor"], torch.device("cpu"), trainable=False)
    rollout = build_engine("vllm", model_path=model, tp_size=args.rollout_tp, tp_group=meshes["rollout"].my_tp_group(),
                           max_model_len=128, seed=0, kv_cache_gb=0.1)
    sync = WeightSync(actor, rollout, meshes["rollout"], dtype=torch.float32, bucket_mb=args.bucket_mb)
    n_params = sum(torch.Size(s).numel() for _, s in actor.param_shapes())
    times = {"full gather": [], "planned": []}
    recv = {}
    for i in range(args.repeats + 1):  # the first round warms up
        for name in times:
            dist.barrier()
            t0 = time.perf_counter()
            if name == "planned":
                got = sync()["weight_sync/bytes_recv_max"]
            else:
                got = full_gather_sync(actor, rollout, torch.float32, args.bucket_mb << 20)
                t = torch.tensor([float(got)])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                got = float(t)
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
            recv[name] = got
    if rank == 0:
        print(f"{world} ranks, actor tp={args.actor_tp} (dp={world // args.actor_tp}) -> rollout tp={args.rollout_tp}, "
              f"{n_params / 1e6:.1f}M params fp32, {args.bucket_mb} MiB buckets, {args.repeats} repeats")
        print(f"{'method':<12} {'median s':>9} {'recv/rank max':>15}")
        for name, ts in times.items():
            print(f"{name:<12} {statistics.median(ts):>9.3f} {recv[name] / 2**20:>12.2f} MiB")
        print(f"lower bound  {'':>9} {sync.lower_bound / 2**20:>12.2f} MiB")
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
