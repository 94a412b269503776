"""`spmdrl plan`: the planner and the running transport agree, and the shipped GPU configs fit by the plan."""
import functools
import json
import math
import os
import subprocess
import sys

import pytest

from launching import REPO, run
from spmdrl.config import load_config, to_toml
from spmdrl.data.synthetic import make_arith
from spmdrl.metrics import read_jsonl
from spmdrl.tiny import build_tiny

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)  # plans are deterministic: tests that read the same one share it
def plan_json(config: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "spmdrl", "plan", "--config", config, "--json", *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["fits"] else 1)  # `spmdrl plan` exits 1 when something does not fit
    return out


@pytest.mark.dist
@pytest.mark.parametrize("actor_tp", [1, 2], ids=["actor_dp2", "actor_tp2"])
def test_plan_equals_real_sync(tmp_path, actor_tp):
    """A real 2-rank run (FSDP2 actor -> vLLM TP=2) counts the bytes each rank receives in the transport; the
    planner, from config.json alone, must give the same maximum, lower bound and collective count."""
    pytest.importorskip("vllm")
    model = build_tiny(str(tmp_path / "model"), seed=0)
    data = make_arith(str(tmp_path / "data"), n_train=16, n_val=4, seed=0)
    out = tmp_path / "run"
    o = {
        "model.path": model, "data.train_files": f'["{data["train"]}"]', "data.max_prompt_length": 32,
        "data.max_response_length": 8, "data.train_batch_size": 2, "rollout.n": 2, "rollout.kv_cache_gb": 0.1,
        "actor.micro_batch_size": 2, "trainer.total_steps": 1, "trainer.device": "cpu", "trainer.output_dir": str(out),
        "logging.progress": "false", "placement.rollout_tp": 2, "placement.actor_tp": actor_tp,
        "rollout.weight_sync_bucket_mb": 1, "memory.gpus_per_node": 2,
        # dummy: vLLM starts from random weights and the trainer syncs the actor's before the first rollout
        "rollout.load_format": "dummy" if actor_tp == 2 else "auto",
    }
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(to_toml(load_config(None, [f"{k}={v}" for k, v in o.items()])))
    run(["spmdrl.train", "--config", str(cfg_file)], nproc=2, module=True)
    (row,) = read_jsonl(str(out / "metrics.jsonl"))
    plan = plan_json(str(cfg_file))
    ws = plan["weight_sync"]
    # actor dp=2 -> rollout tp=2: half of each tp shard comes from the other rank; actor tp=2 = rollout tp=2
    # (dp=1, so embeddings and norms are whole on both ranks): nothing moves
    assert (row["weight_sync/bytes_recv_max"] > 0) == (actor_tp == 1)
    assert ws["bytes_recv_max"] == row["weight_sync/bytes_recv_max"]
    assert ws["bytes_lower_bound"] == row["weight_sync/bytes_lower_bound"]
    assert ws["collectives"] == row["weight_sync/collectives"]
    assert row["rollout/logprob_diff_mean"] < 1e-5  # vLLM samples with the actor's weights (synced at start if dummy)
    assert row["memory/host_rss_gb"] > 0 and "memory/train_actor_allocated_gb" in row
    assert plan["roles"]["rollout"]["tp_groups"] == [[0, 1]]
    assert plan["roles"]["actor"]["tp"] == actor_tp


@pytest.mark.parametrize("config", ["configs/grpo.toml", "configs/ppo.toml", "configs/ppo_70b.toml"])
def test_shipped_configs_fit(config):
    """The example GPU configs fit an 80 GB H100 node by the plan: every phase, building the engines, saving a
    checkpoint and resuming included, under 0.9 x GPU and host memory, and vLLM finds its share free at start."""
    p = plan_json(os.path.join(REPO, config))
    assert p["fits"] is True, {k: (v["gpu_gb"], v["host_gb"]) for k, v in p["memory"].items()}
    for phase, m in p["memory"].items():
        assert m["gpu_gb"] <= 0.9 * 80, phase
        assert m["host_gb"] <= 0.9 * p["hardware"]["host_memory_gb"], phase
    assert {"build", "load", "rollout", "sync", "train_actor", "checkpoint_save", "resume"} <= set(p["memory"])
    assert p["memory"]["build"]["vllm_start"]["ok"] is True
    ws = p["weight_sync"]
    assert ws["bytes_recv_max"] <= 1.1 * ws["bytes_lower_bound"]
    # parameter counts of the published checkpoints (their safetensors totals)
    published = {"configs/grpo.toml": 7_615_616_512, "configs/ppo.toml": 7_615_616_512,
                 "configs/ppo_70b.toml": 70_553_706_496}[config]
    assert p["model"]["params"] == published
    if config == "configs/grpo.toml":  # actor FSDP2 over 8 ranks, no TP: an eighth each, fp32 master + AdamW
        train = p["memory"]["train_actor"]["gpu"]
        assert train["actor_params"] == pytest.approx(published * 4 / 8 / 2**30, rel=1e-3)
        assert train["actor_optimizer"] == pytest.approx(2 * train["actor_params"], rel=1e-3)


def test_ppo_70b_megatron_plan_by_hand():
    """configs/ppo_70b.toml on the Megatron backend (TP=8 x PP=2 x DP=2 on 32 ranks): per-rank state of the
    heavier (last) stage and the weight-sync bound, computed here from Llama-3.3-70B's dimensions."""
    p = plan_json(os.path.join(REPO, "configs/ppo_70b.toml"))
    a = p["roles"]["actor"]
    assert (a["backend"], a["dp"], a["pp"], a["tp"]) == ("megatron", 2, 2, 8)
    assert a["pp_groups"][0] == [0, 8] and a["dp_groups"][0] == [0, 16]  # tp fastest, then pp, then dp
    h, q, kv, ffn, layers, vocab, tp = 8192, 8192, 1024, 28672, 80, 128256, 8
    padded = -(-vocab // (128 * tp)) * 128 * tp  # megatron pads the vocabulary to a multiple of 128 x tp
    layer_tp = (2 * q * h + 2 * kv * h + 3 * ffn * h) // tp + 2 * h  # norms whole on every tp rank
    last_stage = layers // 2 * layer_tp + h + padded // tp * h  # 40 layers, final norm, lm_head's vocab shard
    train = p["memory"]["train_actor"]["gpu"]
    gib = lambda x: round(x / 2**30, 3)  # noqa: E731
    assert train["actor_params"] == gib(2 * last_stage)  # bf16 weights
    assert train["actor_grads"] == gib(4 * last_stage)  # fp32 grad buffer
    assert train["actor_optimizer"] == gib(12 * last_stage // 2)  # fp32 main + 2 Adam moments over dp = 2
    # sync: rollout rank r needs its vLLM TP shard (1/8 of every tensor; vocabulary rows of 128256 / 8 = 16032,
    # vLLM pads to a multiple of 64 only) and already holds its own stage's 40 layers. The worst rank is tp rank 7:
    # it lacks the other stage's 40 layers, the norm or the vocab tensor of the other stage, and of its own
    # stage's vocab tensor the rows where vLLM's shard (from 7 x 16032) starts before megatron's (7 x 16128)
    vocab_rows = -(-vocab // 64) * 64 // tp
    misaligned = (tp - 1) * (padded // tp - vocab_rows)
    lb = 2 * (layers // 2 * layer_tp + h + vocab_rows * h + misaligned * h)
    ws = p["weight_sync"]
    assert ws["bytes_lower_bound"] == lb
    assert ws["bytes_recv_max"] == ws["bytes_lower_bound"]
    assert ws["bytes_sent_max"] <= 1.1 * ws["bytes_recv_total"] / 32  # senders share the work
    assert p["fits"] is True
    # 1F1B keeps 2 micro-batches in flight on stage 0 (32 per mini-batch per pipeline, pp = 2); with recompute each
    # keeps every layer's input, sequence-parallel (/ tp); without recompute every activation stays
    worst = max(p["memory"]["train_actor"]["gpu"]["actor_activations"], p["memory"]["train_critic"]["gpu"]["critic_activations"])
    assert gib(2 * 40 * 2 * 3072 * h * 2 // tp) < worst < 2
    no_recompute = plan_json(os.path.join(REPO, "configs/ppo_70b.toml"), "model.gradient_checkpointing=false")
    assert no_recompute["memory"]["train_actor"]["gpu"]["actor_activations"] > 10 * worst


def test_host_optimizer_plan_moves_the_optimizer_to_host_memory():
    """configs/ppo_70b.toml with memory.actor_host_optimizer and critic_host_optimizer: the optimizer leaves every
    GPU phase (the actor update, checkpoint save and resume, the build) and lives in host memory in every phase,
    the actor's update included: float32 masters, their gradient copies and two AdamW moments, 16 bytes per local
    parameter of the heavier (last) stage, not divided over dp; nothing else on the GPU changes."""
    base = plan_json(os.path.join(REPO, "configs/ppo_70b.toml"))
    host = plan_json(os.path.join(REPO, "configs/ppo_70b.toml"), "memory.actor_host_optimizer=true",
                     "memory.critic_host_optimizer=true")
    h, q, kv, ffn, layers, vocab, tp = 8192, 8192, 1024, 28672, 80, 128256, 8
    padded = -(-vocab // (128 * tp)) * 128 * tp
    last_stage = layers // 2 * ((2 * q * h + 2 * kv * h + 3 * ffn * h) // tp + 2 * h) + h + padded // tp * h
    gib = lambda x: round(x / 2**30, 3)  # noqa: E731
    for phase, m in host["memory"].items():
        assert not {"actor_optimizer", "critic_optimizer"} & set(m["gpu"]), phase
        assert m["host_per_rank"]["actor_optimizer"] == gib(16 * last_stage), phase
    train, train0 = host["memory"]["train_actor"]["gpu"], base["memory"]["train_actor"]["gpu"]
    assert train0["actor_optimizer"] == gib(12 * last_stage // 2)
    assert train == {k: v for k, v in train0.items() if k != "actor_optimizer"}
    assert host["memory"]["train_actor"]["gpu_gb"] < base["memory"]["train_actor"]["gpu_gb"] - 8
    assert host["fits"] is True


def test_split_plan_shows_the_roles_and_their_bytes():
    """Split placement of configs/grpo.toml (Qwen2.5-7B, 8 GPUs): vLLM TP=4 on ranks 0-3, FSDP2 on ranks 4-7. A
    rollout rank holds nothing of the actor, so it receives its whole bf16 vLLM shard: about a quarter of the
    model (norms are whole on every rank)."""
    p = plan_json(os.path.join(REPO, "configs/grpo.toml"), "placement.mode=split", "placement.rollout_ranks=[0,1,2,3]",
                  "placement.rollout_tp=4", "trainer.max_staleness=1")
    pl = p["placement"]
    assert pl["mode"] == "split" and pl["rollout_ranks"] == [0, 1, 2, 3] and pl["training_ranks"] == [4, 5, 6, 7]
    assert p["roles"]["actor"]["dp_groups"] == [[4, 5, 6, 7]] and p["roles"]["rollout"]["tp_groups"] == [[0, 1, 2, 3]]
    ws = p["weight_sync"]
    assert ws["bytes_recv_max"] == ws["bytes_lower_bound"]
    assert ws["bytes_recv_max"] == pytest.approx(7_615_616_512 * 2 / 4, rel=0.01)
    cfg = load_config(os.path.join(REPO, "configs/grpo.toml"))
    assert pl["samples_per_training_rank"] == cfg.data.train_batch_size * cfg.rollout.n // 4
    assert pl["batch_bytes_per_training_rank"] == pl["samples_per_training_rank"] * pl["batch_row_bytes"]
    assert not any(k.startswith("vllm") for k in p["memory"]["train_actor"]["gpu"])
    assert not any(k.startswith("actor") for k in p["memory"]["rollout"]["gpu"])
    assert "vllm_pool" in p["memory"]["sync_rollout_ranks"]["gpu"]


@pytest.mark.quick
def test_plan_on_an_uncached_hub_id_fails_at_once_in_one_line(tmp_path):
    """No network retries: a hub id whose config.json is not in the HF cache is one line naming the fix."""
    import time

    from typer.testing import CliRunner

    from spmdrl.cli import app

    env = {"HF_HUB_CACHE": str(tmp_path / "empty_cache")}
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["plan", "--config", os.path.join(REPO, "configs", "grpo.toml"),
                                 "model.path=someorg/not-downloaded"], env=env)
    assert r.exit_code == 2 and time.monotonic() - t0 < 20
    (line,) = [x for x in r.output.splitlines() if x.strip()]
    assert line.startswith("error: model.path = 'someorg/not-downloaded': not a local directory")
    assert "huggingface-cli download someorg/not-downloaded config.json" in line


def test_plan_that_does_not_fit_names_the_phase_and_what_to_change():
    from typer.testing import CliRunner

    from spmdrl.cli import app

    r = CliRunner().invoke(app, ["plan", "--config", os.path.join(REPO, "configs", "ppo_70b.toml"), "--gpu-gb", "40"])
    assert r.exit_code == 1, r.output  # a plan that does not fit is a failed check (scripts, CI)
    tail = r.output.split("fits: false\n", 1)[1].splitlines()
    # the phase furthest over the limit, its two largest parts, and a setting for each
    assert tail[0].startswith("  does not fit: phase train_") and "36.00 GiB allowed" in tail[0]
    assert "optimizer" in tail[0] and tail[1].strip().startswith("change ") and "placement." in tail[1]
    assert any("or offload what is idle in this phase to host memory: memory.actor_offload=" in line for line in tail)
    fits = CliRunner().invoke(app, ["plan", "--config", os.path.join(REPO, "configs", "ppo_70b.toml")])
    assert "fits: true" in fits.output and "does not fit" not in fits.output and fits.exit_code == 0


def test_plan_header_world_size_no_tracker_check_and_min_gpus(tmp_path):
    """`plan --world-size 4` said "1 node(s) x 8 GPUs" and refused wandb without an API key; --min-gpus searches
    the fewest GPUs that fit (a tiny model fits on one; nothing fits 1 GiB GPUs)."""
    from typer.testing import CliRunner

    from spmdrl.cli import app

    model = build_tiny(str(tmp_path / "model"), seed=0)
    args = ["plan", "--config", os.path.join(REPO, "configs", "grpo.toml"), f"model.path={model}",
            "data.max_prompt_length=256", "data.max_response_length=256", "placement.actor_tp=1",
            "placement.rollout_tp=1", "placement.ref_tp=1", "logging.backends=[\"wandb\"]", "logging.wandb_mode=online"]
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "none")}
    r = CliRunner().invoke(app, [*args, "--world-size", "4"], env=env)
    assert r.exit_code == 0, r.output
    assert "world 4 ranks (1 node(s) x 4 GPUs of 80.0 GiB" in r.stdout
    r = CliRunner().invoke(app, [*args, "--min-gpus"], env=env)
    assert r.exit_code == 0, r.output
    assert "smallest layout that fits: 1 GPU(s) as configured" in r.stderr
    assert "world 1 ranks (1 node(s) x 1 GPUs" in r.stdout and "fits: true" in r.stdout
    r = CliRunner().invoke(app, [*args, "--min-gpus", "--gpu-gb", "1", "--gpus-per-node", "2", "--max-gpus", "2"], env=env)
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: no layout of up to 2 GPUs fits this config")
    assert "# tried 2 GPU(s) memory.actor_offload=" in r.stderr


@pytest.mark.quick
def test_moe_plan_counts_total_and_active_parameters():
    """The plan's parameter counts of Qwen3-30B-A3B (the model of configs/qwen3_30b_a3b.toml; 30.5B published) and of
    those active per token (8 of 128 experts; 3.3B published), each from the config's shape fields by hand here.
    (The whole plan of that config takes ~30 s here, most of it learning vLLM's reads of 128 experts at TP = 8.)"""
    from spmdrl.models.model import load_hf_config, model_param_shapes
    from spmdrl.plan.estimate import moe_params

    hf = load_hf_config("Qwen/Qwen3-30B-A3B")
    shapes = model_param_shapes(hf)
    H, F, E, k, layers, V = 2048, 768, 128, 8, 48, 151936
    attn = H * 32 * 128 * 2 + H * 4 * 128 * 2 + 2 * 128  # q, o; k, v; q/k norms
    dense = layers * (attn + E * H + 2 * H) + 2 * V * H + H  # + router, 2 layer norms; embeddings, head, final norm
    experts = layers * E * 3 * H * F
    assert sum(math.prod(sh) for _, sh in shapes) == dense + experts
    assert moe_params(hf, shapes) == {"experts": E, "experts_per_token": k, "active_params": dense + experts * k // E}
    assert moe_params(load_hf_config("Qwen/Qwen2.5-7B-Instruct"), []) == {}


def test_long_sequence_plan_divides_activations_by_sp_and_shows_the_longest_sequence():
    """configs/grpo_long.toml (Llama-3.1-8B, prompt + response = 65536 tokens, 8 x 80 GB, actor and ref sp = 2):
    it fits; the actor's activations per rank are those of sp = 1 halved (but the log-prob chunk's logits; the
    all-to-all buffers apart); FSDP2
    still shards over all 8 ranks; the longest trainable sequence grows with sp and covers 64k at sp = 2; the
    sp groups are counted among the communicators."""
    from spmdrl.plan.estimate import build_plan

    path = os.path.join(REPO, "configs", "grpo_long.toml")
    p2 = build_plan(load_config(path))
    p1 = build_plan(load_config(path, ["placement.actor_sp=1", "placement.ref_sp=1"]))
    assert p2["fits"] is True and p2["model"]["params"] == 8_030_261_248
    t1, t2 = p1["memory"]["train_actor"]["gpu"], p2["memory"]["train_actor"]["gpu"]
    assert t2["actor_params"] == t1["actor_params"] and t2["actor_optimizer"] == t1["actor_optimizer"]
    head = 1024 * 128256 * 4 * 3 / 2**30  # the fp32 logits of one log-prob chunk: not per token
    assert t2["actor_activations"] - head == pytest.approx((t1["actor_activations"] - head) / 2, rel=1e-3)
    assert t2["actor_sp_all_to_all"] > 0 and "actor_sp_all_to_all" not in t1
    longest = p2["longest_sequence"]["actor"]["tokens_by_sp"]
    assert list(longest) == [1, 2, 4, 8] and longest[2] >= 65536 and longest[8] > longest[4] > longest[2] > longest[1]
    assert p2["roles"]["actor"]["sp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # each rank gains its sp group, a dp group that no longer spans the world, and FSDP2's dp x sp group
    assert p2["nccl"]["communicators"]["role_meshes"] == p1["nccl"]["communicators"]["role_meshes"] + 3


@pytest.mark.quick
def test_megatron_expert_parallel_state_by_hand():
    """The actor layout of configs/qwen3_30b_a3b.toml (Megatron tp 4 x ep 2), here on one node of 8 ranks, planned from Qwen3-30B-A3B's
    shapes: a rank holds the dense parameters / tp (router and norms whole, the vocabulary padded) plus the expert
    parameters / (tp x ep); gradients alike in float32; the distributed optimizer's 12 bytes a parameter shard over
    dp = 2 for the dense ones and over edp = dp / ep = 1 for the experts; an MoE layer's activations count the
    all-to-all dispatch of each token's hidden state to its top_k experts and back. Each figure by hand here."""
    from spmdrl.dist.layout import RoleLayout
    from spmdrl.models.model import load_hf_config, model_param_shapes
    from spmdrl.plan.estimate import layer_activation_bytes
    from spmdrl.plan.megatron import megatron_memory, megatron_stats

    hf = load_hf_config("Qwen/Qwen3-30B-A3B")
    shapes = model_param_shapes(hf)
    H, F, E, k, layers, V, tp, ep, dp = 2048, 768, 128, 8, 48, 151936, 4, 2, 2
    padded = -(-V // (128 * tp)) * 128 * tp
    attn = (H * 32 * 128 * 2 + H * 4 * 128 * 2) // tp + 2 * 128  # q, o; k, v over tp; q/k norms whole
    dense = layers * (attn + E * H + 2 * H) + 2 * padded // tp * H + H  # + router, 2 norms; embedding, head, norm
    experts = layers * E // ep * 3 * H * F // tp
    for ep_ in (1, ep):
        lay = RoleLayout("actor", tuple(range(8)), dp, 1, tp, ep=ep_)
        st = megatron_stats(shapes, lay, hf)
        assert st["stage_experts"] == [experts * ep // ep_] and st["stage"] == [dense + experts * ep // ep_]
    mem = megatron_memory(st, c=hf, lay=lay, trainable=True, micro=1, seq=1536, lm_head=True, compute_eb=2, ckpt=True,
                          on_gpu=True, in_flight=1, layer_bytes=layer_activation_bytes, chunk=1024)
    n = dense + experts
    assert mem["kinds"] == {"params": 2 * n, "grads": 4 * n, "optimizer": 12 * dense // dp + 12 * experts // (dp // ep)}
    on_host = megatron_memory(st, c=hf, lay=lay, trainable=True, micro=1, seq=1536, lm_head=True, compute_eb=2,
                              ckpt=True, on_gpu=True, in_flight=1, layer_bytes=layer_activation_bytes, chunk=1024,
                              host_optimizer=True)  # float32 masters, gradient copies, 2 moments of every local param
    assert on_host["kinds"]["optimizer"] == 16 * n and "optimizer" not in on_host["train"]
    q, kv = 32 * 128, 4 * 128
    moe_mlp = 4 * E + k * (2 * 2 * H + 2 * 4 * F // tp)  # router logits; dispatch + combine; each expert's MLP
    assert layer_activation_bytes(hf, tp) == 14 * H + 2 * (2 * q + 2 * kv) // tp + moe_mlp


def test_a_mixture_of_experts_on_a_gpu_trains_with_the_host_optimizer_by_default(tmp_path):
    """memory.actor_host_optimizer unset: on a GPU the Megatron actor of a mixture of experts takes the host optimizer
    (megatron's distributed optimizer keeps its experts in a second optimizer, which spmdrl's checkpoints do not
    save), and the plan says so and puts the optimizer in host memory; a dense model keeps the distributed
    optimizer, and on CPU nothing changes. `false` for the mixture of experts is refused before launch, naming the
    cause. The engine takes the same decision from the same function (config.derived.megatron_host_optimizer)."""
    from spmdrl.config import validate
    from spmdrl.config.derived import megatron_host_optimizer
    from spmdrl.errors import ConfigError
    from spmdrl.plan import build_plan

    moe = build_tiny(str(tmp_path / "moe"), arch="qwen3_moe", num_layers=2)
    dense = build_tiny(str(tmp_path / "dense"))

    def plan(model, *overrides):
        cfg = load_config(os.path.join(REPO, "configs/quickstart/grpo.toml"),
                          [f"model.path={model}", "trainer.backend=megatron", "trainer.device=cuda", *overrides])
        validate(cfg, 2, trackers=False)
        return build_plan(cfg, world_size=2)

    p = plan(moe)
    assert p["roles"]["actor"]["optimizer"] == "host", p["roles"]["actor"]
    assert "mixture of experts (4 experts) on a GPU" in p["roles"]["actor"]["optimizer_why"]
    assert "optimizer" not in p["roles"].get("ref", {})  # frozen: no optimizer
    for phase, m in p["memory"].items():
        assert "actor_optimizer" not in m["gpu"] and m["host_per_rank"]["actor_optimizer"] > 0, phase
    assert plan(moe, "memory.actor_host_optimizer=true")["memory"] == p["memory"]
    assert plan(dense)["roles"]["actor"]["optimizer"] == "distributed"
    assert plan(moe, "trainer.device=cpu")["roles"]["actor"]["optimizer"] == "torch AdamW"
    with pytest.raises(ConfigError, match=r"memory.actor_host_optimizer = false with a mixture of experts "
                                          r"\(4 experts\) on a GPU: megatron's distributed optimizer keeps the "
                                          r"expert parameters"):
        plan(moe, "memory.actor_host_optimizer=false")
    assert megatron_host_optimizer(None, "critic", on_gpu=True, experts=0)[0] is False
    assert megatron_host_optimizer(True, "critic", on_gpu=False, experts=0)[0] is True


@pytest.mark.quick
def test_plan_counts_the_requests_partial_rollouts_hold_in_flight_and_the_streams_batches(tmp_path):
    """rollout.partial: each rollout engine holds its share of data.train_batch_size plus rollout.oversample groups
    of rollout.n requests (loop/partial.py), whose KV at full length is counted by hand here; asynchronous split
    also holds one posted batch ahead on each training rank, with each token's version as an extra column."""
    from spmdrl.config import validate
    from spmdrl.plan import build_plan
    from spmdrl.plan.estimate import render

    model = build_tiny(str(tmp_path / "model"))
    hf = json.load(open(os.path.join(model, "config.json")))

    def plan(*overrides):
        cfg = load_config(os.path.join(REPO, "configs/quickstart/grpo.toml"),
                          [f"model.path={model}", "trainer.device=cuda", "rollout.partial=keep",
                           "rollout.enable_sleep_mode=false", *overrides])
        validate(cfg, 2, trackers=False)
        return cfg, build_plan(cfg, world_size=2)

    cfg, p = plan("rollout.oversample=0.5", "placement.rollout_tp=1")  # rollout dp 2
    need = cfg.data.train_batch_size // 2
    requests = (need + -(-need // 2)) * cfg.rollout.n
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * (hf["hidden_size"] // hf["num_attention_heads"]) * 2
    kv = requests * (cfg.data.max_prompt_length + cfg.data.max_response_length) * per_token
    r = p["rollout"]
    assert r["in_flight_requests"] == requests and r["kv_in_flight_gb"] == pytest.approx(kv / 2**30, abs=1e-3)
    assert r["kv_cache_holds_in_flight"] is True
    assert "partial rollouts: %d requests in flight per rollout engine" % requests in render(p)
    assert "in_flight_requests" not in build_plan(load_config(os.path.join(REPO, "configs/quickstart/grpo.toml"), [
        f"model.path={model}", "trainer.device=cuda"]), world_size=2)["rollout"]
    cfg, p = plan("placement.mode=split", "placement.rollout_ranks=[0]", "trainer.max_staleness=2")
    pl = p["placement"]
    # prompts, responses, response_mask and rollout_log_probs by position, 6 per-sample scalars, float64 columns
    sync_row = 8 * (cfg.data.max_prompt_length + 3 * cfg.data.max_response_length + 6)
    assert pl["batches_held_ahead"] == 1 and pl["batch_row_bytes"] == sync_row + 8 * cfg.data.max_response_length
    assert pl["stream_buffer_bytes_per_training_rank"] == pl["batch_bytes_per_training_rank"]
