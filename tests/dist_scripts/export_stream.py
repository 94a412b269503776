"""Stream an FSDP2 engine's weights into an HF directory (engines/hf_writer.py) at dp=2 and at tp=2, then
load it with transformers on rank 0 and compare with the engine's own full parameters. Writes OUT/result.json."""
import argparse
import json
import os

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from spmdrl.config.schema import PlacementConfig
    from spmdrl.dist.collectives import comm_device
    from spmdrl.dist.layout import plan_layout
    from spmdrl.dist.meshes import RoleMeshes
    from spmdrl.engines import build_train_engine, pack_sequences
    from spmdrl.engines.hf_writer import write_hf_weights

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {}
    for tp in (1, 2):
        meshes = RoleMeshes(plan_layout(PlacementConfig(actor_tp=tp), world), rank, "cpu")
        eng = build_train_engine("fsdp", args.model, meshes["actor"], torch.device("cpu"), trainable=True,
                                 optim=dict(lr=1e-2))
        tb = pack_sequences([torch.tensor([5, 6, 7])], [torch.tensor([8, 9])], 0)
        eng.train_step([tb], lambda b, e: (-(e.logprobs(b)[0]).sum(), {}))  # weights now differ from the checkpoint
        out = os.path.join(args.out, f"tp{tp}")
        write_hf_weights(eng, out, 0, rank, dtype=torch.float32, comm_device=comm_device(), bucket_bytes=1 << 20)
        if rank == 0:
            eng.hf_config().save_pretrained(out)
        full = eng.full_state_dict()
        dist.barrier()
        if rank == 0:
            loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
            result[f"tp{tp}"] = {
                "max_diff": max(float((loaded[k] - v).abs().max()) for k, v in full.items()),
                "files": sorted(f for f in os.listdir(out) if f.endswith(".safetensors")),
                "missing": sorted(set(full) - set(loaded)),
            }
        dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
