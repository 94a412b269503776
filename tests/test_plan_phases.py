"""`spmdrl plan`: the build, checkpoint and resume phases and the terms outside the model state (NCCL, vLLM outside
its sleep pool, FSDP2's float32 masters, the weight sync's buffers), each against a figure derived here from the
model's dimensions, the libraries' own code or published NCCL defaults. Pure Python, in process."""
import json
import os

import pytest

from launching import REPO
from spmdrl.config import load_config
from spmdrl.plan import build_plan

GIB = 2**30
gib = lambda x: round(x / GIB, 3)  # noqa: E731 (the plan's rounding)
QWEN7B = 7_615_616_512  # Qwen2.5-7B-Instruct's published parameter count
# NCCL's default FIFO sizes per connected peer and channel (src/init.cc): Simple 4 MiB, LL128, LL; 32 channels
NCCL_RING = 32 * ((1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)


def plan(config: str, *overrides: str) -> dict:
    cfg = load_config(os.path.join(REPO, config), list(overrides))
    return build_plan(cfg, cfg.memory.nodes * cfg.memory.gpus_per_node)


@pytest.fixture(scope="module")
def p70() -> dict:
    return plan("configs/ppo_70b.toml")


# Llama-3.3-70B at Megatron TP=8 x PP=2 x DP=2 (configs/ppo_70b.toml): the last stage of a rank
H, Q, KV, FFN, LAYERS, VOCAB, TP, DP = 8192, 8192, 1024, 28672, 80, 128256, 8, 2
PADDED = -(-VOCAB // (128 * TP)) * 128 * TP
LAYER_TP = (2 * Q * H + 2 * KV * H + 3 * FFN * H) // TP + 2 * H
LAST_STAGE = LAYERS // 2 * LAYER_TP + H + PADDED // TP * H


def megatron_nccl_groups(tp: int, pp: int, dp: int) -> int:
    """How many of megatron-core's process groups (initialize_model_parallel, order tp-cp-ep-pp-dp) have more
    than one rank, from megatron's own RankGenerator."""
    from megatron.core.parallel_state import RankGenerator

    dec = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-pp-dp")
    exp = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-pp-dp")
    sizes = [len(dec.get_ranks(t)[0]) for t in ("dp-cp", "dp", "cp", "tp-pp", "tp", "pp", "tp-dp-cp", "tp-dp", "tp-cp")]
    sizes += [len(exp.get_ranks(t)[0]) for t in ("ep", "tp", "tp-ep", "tp-ep-pp", "dp")]
    pp_group = dec.get_ranks("pp")[0]
    sizes += [len({pp_group[0], pp_group[-1]}), 1]  # embedding group (first and last stage), position embedding
    sizes += [tp * pp * dp]  # the distributed optimizer instance: every tp-ep-pp group of one instance
    return sum(s > 1 for s in sizes)


@pytest.mark.quick
def test_build_phase_70b_by_hand(p70):
    """Engines built one at a time and fully offloaded after their build: the peak is one trainable engine at
    construction (bf16 weights, float32 DDP grad buffer, float32 main-param shard over dp = 2; Adam moments not
    yet), the heavier last stage of the actor; nothing of the other engines."""
    b = p70["memory"]["build"]["gpu"]
    assert b["actor_params"] == gib(2 * LAST_STAGE)
    assert b["actor_grads"] == gib(4 * LAST_STAGE)
    assert b["actor_optimizer"] == gib(4 * LAST_STAGE // DP)
    assert not any(k.startswith(("ref_", "critic_", "vllm")) for k in b)
    # communicators existing while engines are built: world, the role meshes' groups (megatron roles share one
    # dp2 x pp2 x tp8 mesh: 3; rollout dp4 x tp8: 2; the reward role's dp = 32 reuses the world group), megatron's
    assert b["nccl_communicators"] == gib((1 + 3 + 2 + megatron_nccl_groups(8, 2, 2)) * NCCL_RING)
    assert p70["memory"]["build"]["gpu_gb"] == pytest.approx(sum(b.values()), abs=0.01)
    vs = p70["memory"]["build"]["vllm_start"]
    assert vs["ok"] and vs["gpu_free_needed_gb"] == 0.5 * 80


def test_build_phase_keeps_what_is_not_offloaded():
    """With the actor's optimizer kept on the GPU, its main-param shard stays while the critic is built; with
    nothing offloaded, the three engines' construction state adds up and the plan says it does not fit."""
    p = plan("configs/ppo_70b.toml", 'memory.actor_offload=["params","grads"]')
    b = p["memory"]["build"]["gpu"]
    assert b["actor_optimizer"] == gib(4 * LAST_STAGE // DP) and "critic_params" in b and "actor_params" not in b
    full = plan("configs/ppo_70b.toml", "memory.actor_offload=[]", "memory.critic_offload=[]", "memory.ref_offload=[]")
    assert full["memory"]["build"]["gpu_gb"] > 72 and full["fits"] is False
    assert full["memory"]["build"]["vllm_start"]["ok"] is False  # vLLM would find less than 40 GiB free


def test_nccl_communicators_70b(p70):
    """Every phase after vLLM's start counts world + meshes + megatron + vLLM's world group and its TP group twice
    (torch device group and PyNccl), each at NCCL's ring buffers; point-to-point peers of the weight sync."""
    n = p70["nccl"]["communicators"]
    assert n == {"world": 1, "role_meshes": 5, "split_groups": 0, "megatron": megatron_nccl_groups(8, 2, 2), "vllm": 3}
    t = p70["memory"]["train_actor"]["gpu"]
    assert t["nccl_communicators"] == gib(sum(n.values()) * NCCL_RING)
    assert t["nccl_p2p"] > 0 and "nccl_p2p" not in p70["memory"]["resume"]["gpu"]  # resume: no sync has run yet


@pytest.mark.quick
def test_fsdp_masters_are_float32_under_bf16():
    """FSDPEngine keeps float32 master shards for a trainable role whatever model.dtype; only the ref is stored in
    the compute dtype. Qwen2.5-7B over 8 ranks (configs/grpo.toml) with model.dtype = bfloat16."""
    p = plan("configs/grpo.toml", "model.dtype=bfloat16")
    train, build = p["memory"]["train_actor"]["gpu"], p["memory"]["build"]["gpu"]
    assert train["actor_params"] == pytest.approx(QWEN7B * 4 / 8 / GIB, rel=1e-3)
    assert train["actor_grads"] == train["actor_params"]
    assert train["actor_optimizer"] == pytest.approx(2 * train["actor_params"], rel=1e-3)
    # at construction: the float32 shard only (no gradient, AdamW's state is created at the first step)
    assert build["actor_params"] == train["actor_params"] and "actor_optimizer" not in build
    assert build["ref_params"] == pytest.approx(QWEN7B * 2 / 8 / GIB, rel=1e-3)


def tiny_llama(tmp_path, **dims) -> str:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 512,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
           "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, **dims}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.quick
def test_transport_peak_is_the_largest_vllm_layer(tmp_path):
    """One parameter per bucket, nothing moving (FSDP2 actor at TP=2 = vLLM TP=2 on 2 ranks): the peak is the
    largest vLLM layer's full-shaped tensors, all alive at once because vLLM's layerwise reload keeps a layer's
    loaded weights until its last one arrives; gate_proj + up_proj here (one gate_up_proj layer)."""
    from spmdrl.dist.layout import plan_layout, role_backends
    from spmdrl.models.model import load_hf_config, model_param_shapes
    from spmdrl.plan.estimate import weight_sync_plan
    from spmdrl.plan.sync_memory import sync_peak

    path = tiny_llama(tmp_path)
    cfg = load_config(None, [f"model.path={path}", "placement.actor_tp=2", "placement.rollout_tp=2", "memory.gpus_per_node=2",
                             "rollout.engine=vllm"])
    layout = plan_layout(cfg.placement, 2, backends=role_backends(cfg))
    hf = load_hf_config(path)
    sp = weight_sync_plan(model_param_shapes(hf), hf, layout, cfg, 2)
    peak = sync_peak(sp, 1, [0, 1])
    h, ffn, d, heads, kv, vocab, eb = 64, 512, 16, 4, 2, 128, 2
    layers = {"qkv": (heads * d + 2 * kv * d) * h, "o": heads * d * h, "gate_up": 2 * ffn * h, "down": ffn * h,
              "embed": vocab * h, "lm_head": vocab * h}
    largest = max(layers, key=layers.get)
    assert largest == "gate_up"
    assert peak["bucket_full_tensors"] + peak["reload_retained"] == layers[largest] * eb
    assert peak["reload_retained"] == ffn * h * eb  # gate_proj waited for up_proj
    assert peak["reload_layer_copy"] == layers[largest] * eb // 2  # the layer's TP-local copy vLLM processes
    assert peak["send_buffers"] == peak["recv_buffers"] == 0


@pytest.mark.quick
def test_transport_peak_counts_received_and_sent(tmp_path):
    """Actor dp=2 -> vLLM TP=2: each rank receives the half of its TP slice the other rank holds, in one bucket
    (the tiny model is below 1 MiB), and sends as much (twice: slices and their concatenation)."""
    path = tiny_llama(tmp_path)
    cfg = load_config(None, [f"model.path={path}", "placement.rollout_tp=2", "memory.gpus_per_node=2", "memory.nodes=1",
                             "rollout.engine=vllm", "rollout.weight_sync_bucket_mb=1"])
    p = build_plan(cfg, 2)
    s = p["memory"]["sync"]["gpu"]
    params = sum(v for v in {"embed": 128 * 64, "lm_head": 128 * 64, "norm": 64}.values()) + 2 * (
        (64 + 2 * 32 + 64) * 64 + 3 * 512 * 64 + 2 * 64)
    assert p["model"]["params"] == params
    assert s["sync_bucket_full_tensors"] == gib(params * 2)  # every tensor full-shaped, bf16
    assert s["sync_recv_buffers"] == gib(p["weight_sync"]["bytes_recv_max"])
    assert s["sync_send_buffers"] == gib(2 * p["weight_sync"]["bytes_sent_max"])


def test_split_training_ranks_keep_no_sends():
    """Split placement (configs/grpo.toml, vLLM TP=4 on ranks 0-3, FSDP2 on 4-7): every bucket's exchange completes
    before the next (nothing stays posted past the sync), so no phase of a training rank holds send buffers, and
    a training rank has no vLLM."""
    p = plan("configs/grpo.toml", "placement.mode=split", "placement.rollout_ranks=[0,1,2,3]", "placement.rollout_tp=4",
             "trainer.max_staleness=1")
    for phase in ("train_actor", "ref_forward", "checkpoint_save"):
        assert not any("pending" in k or k.startswith("vllm") for k in p["memory"][phase]["gpu"])


def test_checkpoint_and_resume_70b(p70):
    """One engine at a time: with every kind offloaded, the save (after the sync: vLLM's weights awake) holds the
    actor's params and optimizer state brought back for it (bf16 weights + fp32 main weights and 2 Adam moments of
    the dp shard, the last pipeline stage: the larger one), never its gradients, and DCP's staging of the largest
    shard (the embedding's float32 main weights: 16,128 vocabulary rows x 8192); resume: the same without vLLM's
    weights (asleep at level 2)."""
    c, r = p70["memory"]["checkpoint_save"], p70["memory"]["resume"]
    assert c["gpu"]["dcp_staging"] == gib(PADDED // TP * H * 4) == r["gpu"]["dcp_staging"]
    assert c["gpu"]["vllm_weights"] == p70["rollout"]["vllm_weights_gb"]  # awake after the sync, left so
    for phase in (c, r):
        assert phase["gpu"]["actor_params"] == gib(2 * LAST_STAGE)
        assert phase["gpu"]["actor_optimizer"] == gib(12 * LAST_STAGE // DP)
        assert not any(k.endswith("_grads") or k.startswith(("critic_", "ref_")) for k in phase["gpu"])
    assert "vllm_pool" not in c["gpu"] and not any(k in r["gpu"] for k in ("vllm_pool", "vllm_weights"))


def test_vllm_outside_its_pool(p70):
    """While vLLM sleeps its CUDA graph pool, runner buffers and all-reduce buffers stay; enforce_eager drops the
    graphs; while awake only the all-reduce buffers are outside its gpu_memory_utilization budget."""
    t, ro = p70["memory"]["train_actor"]["gpu"], p70["memory"]["rollout"]["gpu"]
    assert t["vllm_cudagraph_pool"] == 1 and t["vllm_runner_buffers"] == gib(8192 * (H * 2 + 64))
    assert ro["vllm_allreduce_buffers"] == t["vllm_allreduce_buffers"] > 0 and "vllm_cudagraph_pool" not in ro
    eager = plan("configs/ppo_70b.toml", "rollout.enforce_eager=true")
    assert "vllm_cudagraph_pool" not in eager["memory"]["train_actor"]["gpu"]
