"""`spmdrl plan` for roles on the Megatron-core backend: what a (dp, pp, tp) rank holds and needs, per phase.

Per rank, for the pipeline stage that needs the most (stages differ: the first holds the embeddings and the
most micro-batches in flight, the last the output layer, its logits and the value head):

  params      the stage's TP shard in the compute dtype (megatron's model weights, vocab padding included); with
              expert parallelism (ep) a mixture of experts' dense parameters / tp plus its expert parameters /
              (tp x ep): each rank holds E / ep experts, each cut over tp
  grads       megatron DDP's contiguous gradient buffer, float32 (grad_reduce_in_fp32, as Megatron-LM sets
              for bf16), the size of the stage's shard; it persists between steps, so it counts as
              resident state unless memory.<role>_offload lists "grads"
  optimizer   the distributed optimizer: float32 main weights (only when the model weights are not float32)
              plus AdamW's exp_avg and exp_avg_sq, 4 + 4 + 4 bytes per parameter divided over the dp ranks for
              dense parameters and over the expert-data-parallel ranks (edp = dp / ep, the replicas of an
              expert) for expert parameters. With memory.<role>_host_optimizer the host optimizer instead
              (spmdrl/engines/megatron/host_optim.py): float32 masters, their gradient copies and the two
              moments, 16 bytes per local parameter, not divided over dp, in host memory: nothing on the GPU
  activations 1F1B keeps min(pp - p, m) micro-batches in flight on stage p (m = micro-batches per mini-batch
              per dp rank). With full recompute (model.gradient_checkpointing) a micro-batch keeps each layer's
              input (bf16, divided by tp under sequence parallelism, which the engine turns on with TP on GPU),
              plus one layer's recomputed activations during its backward; without recompute every layer's
              activations (`plan.estimate.layer_activation_bytes`, its sequence-parallel part divided by tp). The last
              stage adds one chunk of actor.logprob_chunk_size tokens of vocab-parallel logits (the engine
              projects response tokens chunk by chunk under checkpointing: Vp / tp columns, fp32, three tensors:
              logits, exponentials, gradient). A mixture of experts' layer activations include the
              all-to-all dispatch: each token's hidden state sent to its top_k experts and their outputs sent
              back (`plan.estimate.layer_activation_bytes`).

Forward-only passes (ref, old log-probs) keep one layer's activations and the logits of one micro-batch.
These are estimates for a GPU run.
"""
from __future__ import annotations

import math

from spmdrl.dist.blocks import EXPERTS, MEGATRON_VOCAB, megatron_blocks, megatron_padded_vocab, numel, pp_stage_layers


def megatron_stats(params, lay, hf, padded_vocab: int | None = None) -> dict:
    """Per-stage element counts of a Megatron role's shard (the largest tp rank), vocab padding included, and
    of that the expert parameters ("stage_experts"; every expert-parallel rank holds as many)."""
    grid = lay.mesh_ranks()
    pv = padded_vocab or megatron_padded_vocab(hf.vocab_size, lay.tp)
    blocks = megatron_blocks(params, grid, num_layers=hf.num_hidden_layers, padded_vocab=pv, ep=lay.ep)
    stage_of = {grid[0][p][t]: (p, t) for p in range(lay.pp) for t in range(lay.tp)}
    per: dict[tuple[int, int], list[int]] = {}  # (stage, tp rank) -> [all, experts]
    largest = 0  # the largest single tensor a rank holds
    for name, bs in blocks.items():
        expert = bool(EXPERTS.search(name))
        for rank, b in bs:
            if rank not in stage_of:  # dp replicas (expert-parallel rank 0's) hold the same as dp rank 0
                continue
            n = numel(b)
            if MEGATRON_VOCAB.search(name):  # megatron also holds the padding rows, Vp / tp in all
                n = pv // lay.tp * math.prod(b[1][1:])
            counts = per.setdefault(stage_of[rank], [0, 0])
            counts[0] += n
            counts[1] += n if expert else 0
            largest = max(largest, n)
    worst = [max(range(lay.tp), key=lambda t: per.get((p, t), [0, 0])[0]) for p in range(lay.pp)]
    stage = [per.get((p, t), [0, 0])[0] for p, t in enumerate(worst)]
    layers = pp_stage_layers(hf.num_hidden_layers, lay.pp)
    return {"stage": stage, "stage_experts": [per.get((p, t), [0, 0])[1] for p, t in enumerate(worst)],
            "shard": max(stage), "layers_per_stage": [len(x) for x in layers], "largest": largest,
            "padded_vocab": pv, "total": sum(math.prod(s) for _, s in params)}


def micro_batches_in_flight(cfg, role: str, lay) -> int:
    """m: micro-batches per mini-batch on one dp rank, the most 1F1B can have in flight on stage 0."""
    from spmdrl.config.derived import micro_batch_samples, mini_batch_prompts

    mini = mini_batch_prompts(cfg) * cfg.rollout.n // max(1, lay.dp)
    return max(1, -(-mini // micro_batch_samples(cfg, role)))


def megatron_memory(st: dict, *, c, lay, trainable: bool, micro: int, seq: int, lm_head: bool, compute_eb: int,
                    ckpt: bool, on_gpu: bool, in_flight: int, layer_bytes, chunk: int,
                    host_optimizer: bool = False) -> dict:
    """kinds (resident state), train (the worst stage during the update, on the GPU) and forward (worst stage,
    forward only) in bytes per rank, for one Megatron role, and which stages those are (worst_stage); with the
    host optimizer, kinds' "optimizer" is in host memory ("host_kinds") and never on the GPU.
    layer_bytes(c, tp) is plan.layer_activation_bytes."""
    tokens = micro * seq
    sp = lay.tp if on_gpu and lay.tp > 1 else 1
    head = min(chunk, tokens) * st["padded_vocab"] // lay.tp * 4 * 3 if lm_head else 0
    seq_part = 14 * c.hidden_size  # norms (fp32 in, bf16 out) and the attention input: sequence-sharded under SP
    one_layer = tokens * (layer_bytes(c, lay.tp) - seq_part + seq_part // sp)
    boundary = tokens * c.hidden_size * 2 // sp  # a stage's input/output activation (p2p buffers)

    edp = lay.dp // lay.ep

    def kinds_of(n: int, experts: int) -> dict:
        k = {"params": n * compute_eb}
        if trainable:
            main = 4 if compute_eb != 4 else 0
            k["grads"] = n * 4
            k["optimizer"] = (n * 16 if host_optimizer else
                              (n - experts) * (main + 8) // lay.dp + experts * (main + 8) // edp)
        return k

    on_host = ("optimizer",) if host_optimizer and trainable else ()

    train, forward, worst_t, worst_f, stages = {}, {}, -1, -1, {}
    for p in range(lay.pp):
        k = kinds_of(st["stage"][p], st["stage_experts"][p])
        last = p == lay.pp - 1
        fl = min(lay.pp - p, in_flight)
        per_mb = st["layers_per_stage"][p] * (tokens * c.hidden_size * 2 // sp if ckpt else one_layer)
        on_gpu_kinds = {x: v for x, v in k.items() if x not in on_host}
        t = {**on_gpu_kinds,
             "activations": fl * per_mb + (one_layer if ckpt else 0) + (head if last else 0) + 2 * boundary}
        f = {"params": k["params"], "activations": one_layer + (head if last else 0) + 2 * boundary}
        if trainable and sum(t.values()) > worst_t:
            worst_t, train, stages["train"] = sum(t.values()), t, p
        if sum(f.values()) > worst_f:
            worst_f, forward, stages["forward"] = sum(f.values()), f, p
    big = max(range(lay.pp), key=lambda p: st["stage"][p])
    kinds = kinds_of(st["stage"][big], st["stage_experts"][big])
    build = megatron_build(st["stage"][big], trainable, compute_eb, lay.dp, st["stage_experts"][big], edp)
    if on_host:  # the masters are built in host memory
        build = {key: {x: v for x, v in b.items() if x not in on_host} for key, b in build.items()}
    return {"kinds": kinds, "train": train, "forward": forward, "worst_stage": stages, "host_kinds": on_host, **build}


def megatron_build(n: int, trainable: bool, compute_eb: int, dp: int, experts: int = 0, edp: int = 1) -> dict:
    """What constructing the engine allocates for a stage of n parameters (per rank, bytes): "build" at its
    peak, "build_kinds" once built. A frozen engine holds its weights. A trainable one: megatron DDP allocates
    its contiguous param buffer (compute dtype) and float32 grad buffer at once, then copies each parameter
    into the param buffer and frees the original (megatron-core 0.16.1 distributed/param_and_grad_buffer.py),
    so for a moment the weights exist twice; then the distributed optimizer clones its float32 main-param
    shard (1/dp; 1/edp of the `experts` expert parameters among the n; none when the weights are float32).
    Adam's moments are created at the first step or at a checkpoint load (torch Adam's lazy state;
    spmdrl/engines/megatron/dist_optim.py init_state)."""
    if not trainable:
        return {"build": {"params": n * compute_eb}, "build_kinds": {"params": n * compute_eb}}
    main_eb = 4 if compute_eb != 4 else 0
    main = (n - experts) * main_eb // dp + experts * main_eb // edp
    kinds = {"params": n * compute_eb, "grads": n * 4, "optimizer": main}
    copying = {"params": n * compute_eb, "grads": n * 4, "ddp_param_copy": n * compute_eb}
    return {"build": copying if sum(copying.values()) > sum(kinds.values()) else kinds, "build_kinds": kinds}
