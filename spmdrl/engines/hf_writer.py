"""Writing an HF model directory from sharded parameters without gathering the model anywhere.

The export is a weight sync whose only receiver is the writing rank: the reshard planner gives every
parameter's full block to that rank, the transport moves each bucket there (one batched p2p exchange per
bucket, cast to the export dtype before sending), and the writer puts each bucket into its own safetensors
file. At most one bucket of full tensors exists at a time, on one rank; the model's `*.safetensors.index.json`
maps every parameter to its file, as `from_pretrained` expects.
"""
from __future__ import annotations

import json
import os

import torch

from spmdrl.dist.blocks import full_block
from spmdrl.reshard.plan import plan_sync
from spmdrl.reshard.transport import execute, held_shards


class ShardWriter:
    """Receives buckets of (name, full tensor) and writes model-0000k-of-0000n.safetensors files."""

    def __init__(self, out_dir: str, n_files: int):
        self.out_dir, self.n_files, self.k = out_dir, n_files, 0
        self.index: dict[str, str] = {}
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        self.k += 1
        name = f"model-{self.k:05d}-of-{self.n_files:05d}.safetensors"
        tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
        save_file(tensors, os.path.join(self.out_dir, name), metadata={"format": "pt"})
        for n, t in tensors.items():
            self.index[n] = name
            self.total_bytes += t.numel() * t.element_size()

    def finish(self) -> None:
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.index.items()))}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def write_hf_weights(engine, out_dir: str, writer_rank: int, rank: int, *, dtype: torch.dtype,
                     comm_device: torch.device, bucket_bytes: int = 1 << 30) -> None:
    """Every rank of the engine's mesh calls this; `writer_rank` writes. dtype: the export dtype."""
    params = engine.param_shapes()
    plan = plan_sync(params, engine.source_blocks(), {n: [(writer_rank, full_block(s))] for n, s in params},
                     torch.empty((), dtype=dtype).element_size())
    writer = ShardWriter(out_dir, len(plan.buckets(bucket_bytes))) if rank == writer_rank else None
    shards = held_shards(engine.weight_shards())
    execute(plan, shards, rank, dtype=dtype, comm_device=comm_device, bucket_bytes=bucket_bytes,
            deliver=writer.write if writer else (lambda bucket: None))
    if writer:
        writer.finish()
