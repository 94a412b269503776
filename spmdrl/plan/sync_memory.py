"""Device memory of the weight sync on one rank, bucket by bucket (what spmdrl/reshard/transport.py allocates and
what vLLM's layerwise reload keeps).

Per bucket a rank holds, at once:
  bucket_full_tensors   one full-shaped tensor per parameter of the bucket that it receives for vLLM
                        (transport.execute: `torch.empty(plan.shapes[name])`; vLLM's loaders narrow to the rank's
                        slice, so at TP = t only 1/t of it is ever read)
  reload_retained       full-shaped tensors of earlier buckets whose vLLM layer is not complete yet: vLLM 0.32's
                        layerwise reload buffers every loaded weight of a layer (`info.loaded_weights`) until the
                        layer's last weight arrives (model_executor/model_loader/reload/layerwise.py,
                        online_process_loader), e.g. q_proj and k_proj until v_proj arrives (one qkv_proj layer)
  reload_layer_copy     the TP-local copy of the layer vLLM materialises to process it (`_layerwise_process`:
                        materialize_layer, then a copy back into the original storage)
  send_buffers          the bucket's slices for each peer (cast to the rollout dtype) and their concatenation:
                        counted twice, an upper bound where a slice is a view
  recv_buffers          one flat receive buffer per sending peer

Layers are vLLM's modules as the dense Llama / Qwen2 / Mistral family names them: q/k/v_proj form qkv_proj and
gate/up_proj form gate_up_proj; every other parameter is its own layer (for other families an approximation: a
fused expert tensor, for one, is all of its layer already). A vocabulary padded by vLLM beyond
what the rank loads (a vocabulary that is not a multiple of 64) would stay buffered until the sync ends; that is
not modelled (the shipped models' vocabularies are multiples of 64).

Every rank waits for a bucket's exchange before the next one, in split placement too: one bucket's buffers at a
time.
"""
from __future__ import annotations

import math

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
SEND_COPIES = 2  # slices + their concatenation


def vllm_layer(name: str) -> str:
    """The vLLM module an HF parameter is loaded into (model.layers.0.self_attn.k_proj.weight ->
    model.layers.0.self_attn.qkv_proj)."""
    module = name.rpartition(".")[0]
    parent, _, last = module.rpartition(".")
    last = FUSED.get(last, last)
    return f"{parent}.{last}" if parent else last


def _moved(plan) -> tuple[dict, dict]:
    """name -> rank -> bytes sent / received by that rank."""
    sent: dict[str, dict[int, int]] = {}
    recv: dict[str, dict[int, int]] = {}
    for name, ts in plan.transfers.items():
        for t in ts:
            k = math.prod(t.block[1]) * plan.elem_bytes
            sent.setdefault(name, {})[t.src] = sent.get(name, {}).get(t.src, 0) + k
            recv.setdefault(name, {})[t.dst] = recv.get(name, {}).get(t.dst, 0) + k
    return sent, recv


def sync_peak(plan, bucket_bytes: int, ranks) -> dict[str, int]:
    """The breakdown (bytes) of the largest per-bucket footprint over `ranks` (see the module docstring)."""
    eb = plan.elem_bytes
    sent, recv = _moved(plan)
    buckets = plan.buckets(bucket_bytes)
    best: dict[str, int] = {}
    for r in ranks:
        targeted = {n for n, tg in plan.target_of.items() if r in tg}
        members: dict[str, set[str]] = {}
        for n in targeted:
            members.setdefault(vllm_layer(n), set()).add(n)
        remaining = {layer: set(ns) for layer, ns in members.items()}
        held: dict[str, int] = {}
        for names in buckets:
            mine = [n for n in names if n in targeted]
            done, copy = set(), 0
            for n in mine:
                layer = vllm_layer(n)
                if remaining[layer] <= set(mine) and layer not in done:
                    done.add(layer)
                    copy = max(copy, sum(math.prod(b[1]) for m in members[layer] for b in plan.target_of[m][r]) * eb)
            fig = {"bucket_full_tensors": sum(math.prod(plan.shapes[n]) for n in mine) * eb,
                   "reload_retained": sum(held.values()),
                   "reload_layer_copy": copy,
                   "send_buffers": SEND_COPIES * sum(sent.get(n, {}).get(r, 0) for n in names),
                   "recv_buffers": sum(recv.get(n, {}).get(r, 0) for n in names)}
            if sum(fig.values()) > sum(best.values()):
                best = fig
            for n in mine:
                layer = vllm_layer(n)
                held[layer] = held.get(layer, 0) + math.prod(plan.shapes[n]) * eb
                remaining[layer].discard(n)
                if not remaining[layer]:
                    del held[layer]
    return best or {"bucket_full_tensors": 0}
