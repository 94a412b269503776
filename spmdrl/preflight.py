"""Checks on disk, run before any process group, model load or engine build (by `spmdrl train` before it
launches, and by every rank before it initialises): the model and tokenizer, the context length, the output
directory, and what `checkpoint.resume` will load; and, for a job that spans several nodes, the host (an
address gloo can bind that the other nodes reach, the locked-memory limit NCCL's InfiniBand transport needs).
Each failure is one ConfigError/CheckpointError line.

A run never mixes with another: a fresh run (resume=off, or auto finding no checkpoint) into an output_dir
that holds another run's checkpoints or metrics is refused unless trainer.overwrite clears them. One case
starts over without asking: resume=auto, no checkpoint directory at all, and output_dir/config.toml equal to
this run's config (up to the keys that may change on resume): the same run relaunched before its first
checkpoint; its partial metrics and events are moved to output_dir/previous/<n>/, never deleted.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import resource
import shutil
import socket
import tomllib
from dataclasses import dataclass

from spmdrl.checkpoint.files import checkpoint_root, find_checkpoint, list_checkpoints
from spmdrl.checkpoint.verify import check_saved_config, config_differences, intact, newest_intact, read_manifest
from spmdrl.dist.node import nodes_in_job
from spmdrl.errors import CheckpointError, ConfigError

log = logging.getLogger("spmdrl")

RUN_FILES = ("metrics.jsonl", "tensorboard")
# what a tokenizer directory holds (any of them): transformers loads a one-token tokenizer without them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer.tiktoken", "merges.txt")


@dataclass
class Plan:
    """What the run will do: resume from `resume` (None: start fresh) at `resume_step`."""

    resume: str | None
    resume_step: int = 0
    clear: tuple[str, ...] = ()  # another run's files that trainer.overwrite removes (rank 0, before start)
    keep: tuple[str, ...] = ()  # an attempt of this run that saved no checkpoint: moved to output_dir/previous/<n>
    steps_line: str = ""  # trainer.total_epochs resolved to a step count (resolve_total_epochs), said at start


def looks_local(path: str) -> bool:
    """A path the user means on disk (a hub id is 'org/name' or 'name')."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path


def check_model_dir(key: str, path: str, *, tokenizer: bool = False, trust_remote_code: bool = False) -> dict | None:
    """The HF config of a local model directory (None for a hub id); a one-line ConfigError otherwise."""
    if not path:
        return None
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        if looks_local(path):
            raise ConfigError(f"{key} = {path!r}: no such directory; give an HF model directory or a hub id")
        return None
    if not os.path.isdir(full):
        raise ConfigError(f"{key} = {path!r} is a file; give an HF model directory (with config.json) or a hub id")
    if tokenizer:
        if not any(os.path.exists(os.path.join(full, f)) for f in TOKENIZER_FILES):
            raise ConfigError(f"{key} = {path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])} ...); "
                              "copy the tokenizer there or set model.tokenizer_path to its directory")
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(full, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise ConfigError(f"{key} = {path!r}: the tokenizer does not load ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
        return None
    cfg_path = os.path.join(full, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{key} = {path!r} has no config.json; give an HF model directory or a hub id")
    from spmdrl.models.checkpoint import check_weights

    check_weights(key, full)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key} = {path!r}: config.json is unreadable ({e})") from None


def check_models(cfg) -> None:
    m = cfg.model
    hf = check_model_dir("model.path", m.path)
    check_model_dir("model.tokenizer_path" if m.tokenizer_path else "model.path", m.tokenizer_path or m.path,
                    tokenizer=True, trust_remote_code=m.trust_remote_code)
    if cfg.critic.enable and cfg.critic.path:
        check_model_dir("critic.path", cfg.critic.path)
    if cfg.reward.model_path:
        check_model_dir("reward.model_path", cfg.reward.model_path)
    if cfg.reward.model_tokenizer_path:
        check_model_dir("reward.model_tokenizer_path", cfg.reward.model_tokenizer_path, tokenizer=True,
                        trust_remote_code=m.trust_remote_code)
    check_teacher(cfg)
    context = (hf or {}).get("max_position_embeddings")
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if isinstance(context, int) and need > context:
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {cfg.data.max_prompt_length} + "
            f"{cfg.data.max_response_length} = {need} exceeds the model's context of {context} tokens "
            f"(max_position_embeddings in {m.path}/config.json); lower them"
        )


def check_teacher(cfg) -> None:
    """distill.teacher_path: a model directory (or hub id) whose tokenizer is the student's: the same token ids
    for the same strings (vocabulary, special tokens) and the same chat template, since the teacher scores the
    student's token ids as they are. Checked where both tokenizers are on disk (a hub id: by spmdrl.train once
    spmdrl.hub has its snapshot, before anything is built)."""
    d, m = cfg.distill, cfg.model
    if not d.teacher_path:
        return
    teacher_hf = check_model_dir("distill.teacher_path", d.teacher_path)
    check_teacher_rows(d.teacher_path, teacher_hf, m.path, _model_config(m.path))
    key = "distill.teacher_tokenizer_path" if d.teacher_tokenizer_path else "distill.teacher_path"
    teacher_tok, student_tok = d.teacher_tokenizer_path or d.teacher_path, m.tokenizer_path or m.path
    if not (os.path.isdir(os.path.expanduser(teacher_tok)) and os.path.isdir(os.path.expanduser(student_tok))):
        return
    check_model_dir(key, teacher_tok, tokenizer=True, trust_remote_code=m.trust_remote_code)
    from transformers import AutoTokenizer

    teacher, student = (AutoTokenizer.from_pretrained(os.path.expanduser(p), trust_remote_code=m.trust_remote_code)
                        for p in (teacher_tok, student_tok))
    tv, sv = teacher.get_vocab(), student.get_vocab()
    if tv != sv:
        differ = sorted(set(tv.items()) ^ set(sv.items()), key=lambda x: x[1])
        tok, idx = differ[0]
        raise ConfigError(
            f"{key} = {teacher_tok!r}: the teacher's vocabulary differs from the student's ({len(tv)} vs {len(sv)} "
            f"tokens; first difference: {tok!r} at id {idx}); distillation scores the student's token ids with the "
            "teacher, so both need one tokenizer family: use a teacher of the student's family")
    if teacher.chat_template != student.chat_template:
        raise ConfigError(
            f"{key} = {teacher_tok!r}: the teacher's chat template differs from the student's, so the teacher would "
            "score prompts rendered in a format it was not trained on; use a teacher of the student's family")


def check_teacher_rows(teacher_path: str, teacher_hf: dict | None, student_path: str, student_hf: dict | None) -> None:
    """The teacher's embedding (config.json `vocab_size`, its rows) has a row for every token id the student can
    sample: the student's own `vocab_size`. A teacher with fewer rows passes the tokenizer checks when the extra
    ids are padding, and would fail at its first forward pass on an id it has no row for."""
    tv, sv = (h.get("vocab_size") if isinstance(h, dict) else None for h in (teacher_hf, student_hf))
    if isinstance(tv, int) and isinstance(sv, int) and tv < sv:
        raise ConfigError(
            f"distill.teacher_path = {teacher_path!r}: the teacher's embedding has {tv} rows (vocab_size in its "
            f"config.json) and the student ({student_path}) samples token ids up to {sv - 1} (vocab_size {sv}); the "
            "teacher scores the student's ids as they are, so use a teacher whose vocab_size is at least the "
            "student's (the larger models of the same family)")


def check_inputs(cfg) -> None:
    """The files a run reads exist: data.train_files, data.val_files, and model.path when it looks local."""
    for key in ("data.train_files", "data.val_files"):
        for path in getattr(cfg.data, key.split(".")[1]):
            if not os.path.isfile(os.path.expanduser(path)):
                what = "is a directory; list the .parquet/.jsonl files inside it" if os.path.isdir(path) else \
                    "no such file"
                raise ConfigError(f"{key}: {path!r}: {what} (check the path; `spmdrl data` writes example files)")
    if cfg.model.path and looks_local(cfg.model.path) and not os.path.isdir(os.path.expanduser(cfg.model.path)):
        raise ConfigError(f"model.path = {cfg.model.path!r}: no such directory; give an HF model directory or a hub id")


def check_writable(out: str) -> None:
    """output_dir exists and takes a file, or its nearest existing ancestor is a writable directory."""
    bad = ConfigError(f"trainer.output_dir = {out!r} cannot be created or written; choose a writable directory")
    if not os.path.isdir(out):
        parent = os.path.dirname(os.path.abspath(out))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if os.path.exists(out) or not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            raise bad
        return
    try:
        probe = os.path.join(out, f".spmdrl-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"trainer.output_dir = {out!r} cannot be written ({e.strerror or e}); choose a writable "
                          "directory") from None


def _used_by_another_run(out: str) -> list[str]:
    root = checkpoint_root(out)
    found = []
    if os.path.isdir(root) and any(n.startswith("step_") for n in os.listdir(root)):
        found.append(f"checkpoints in {root}")
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(f"metrics in {metrics}")
    tb = os.path.join(out, "tensorboard")
    if os.path.isdir(tb) and os.listdir(tb):
        found.append(f"tensorboard events in {tb}")
    return found


def _same_config(path: str, config_toml: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return not config_differences(tomllib.loads(f.read()), tomllib.loads(config_toml))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False


def check_resume(cfg, config_toml: str, world_size: int | None = None) -> Plan:
    """What checkpoint.resume loads, checked (complete, intact, same config); and no mixing of two runs."""
    out, mode = cfg.trainer.output_dir, cfg.checkpoint.resume
    own_root = os.path.abspath(checkpoint_root(out))
    path = None
    if mode == "auto":
        path = newest_intact(checkpoint_root(out))
    elif mode != "off":
        try:
            path = find_checkpoint(mode)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.resume = {mode!r}: {e}") from None
        why = intact(path)
        if why:
            raise CheckpointError(f"checkpoint.resume = {mode!r}: {why}")
    restart = False
    if path is None or os.path.dirname(os.path.abspath(path)) != own_root:
        used = _used_by_another_run(out)
        # the same run relaunched before its first checkpoint: same config, nothing to resume, no checkpoints
        restart = mode == "auto" and path is None and not any("checkpoints" in u for u in used) and \
            _same_config(os.path.join(out, "config.toml"), config_toml)
        if used and not cfg.trainer.overwrite and not restart:
            start = "starts fresh" if path is None else f"resumes from {path}, outside it,"
            hint = "checkpoint.resume=auto to continue it, " if mode == "off" and list_checkpoints(checkpoint_root(out)) else ""
            raise ConfigError(
                f"trainer.output_dir = {out!r} holds another run ({'; '.join(used)}) and this run {start}; pass "
                f"{hint}trainer.overwrite=true to delete them, or a new trainer.output_dir"
            )
    if path is None:
        found = tuple(p for p in (checkpoint_root(out), *(os.path.join(out, f) for f in RUN_FILES)) if os.path.exists(p))
        if cfg.trainer.overwrite:
            return Plan(None, clear=found)
        return Plan(None, keep=found if restart else ())
    manifest = read_manifest(path)
    if os.path.isfile(os.path.join(path, "config.toml")):
        check_saved_config(path, config_toml)
    check_resume_fits(cfg, path, manifest, world_size)
    return Plan(path, int(manifest.get("step", 0)))


# what makes two models different networks (the checkpoint's hf/config.json against model.path's config.json)
ARCH_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size", "tie_word_embeddings")


def check_resume_fits(cfg, path: str, manifest: dict, world_size: int | None) -> None:
    """What the loading ranks would refuse after building every engine, refused before launch: a split run with
    batches in flight (trainer.max_staleness > 0) on another world size, and another model."""
    saved_ws = manifest.get("world_size")
    if cfg.placement.mode == "split" and cfg.trainer.max_staleness > 0 and world_size and saved_ws != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {saved_ws} ranks with batches in flight (trainer.max_staleness = "
            f"{cfg.trainer.max_staleness}, split placement), and this run has {world_size}: each rank's in-flight "
            f"batches belong to its rank; resume it on {saved_ws} ranks (--nproc {saved_ws} / torchrun "
            "--nproc-per-node), or start a new run"
        )
    mine = _model_config(cfg.model.path)
    theirs = _model_config(os.path.join(path, "hf"))
    if mine is None or theirs is None:
        return
    diffs = [f"{k} = {theirs.get(k)!r} in the checkpoint, {mine.get(k)!r} in model.path"
             for k in ARCH_KEYS if k in mine and k in theirs and mine[k] != theirs[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is for a different model ({'; '.join(diffs[:3])}); check model.path, "
                              "or start a new run (checkpoint.resume=off and a new trainer.output_dir)")


def _model_config(model_dir: str) -> dict | None:
    try:
        with open(os.path.join(os.path.expanduser(model_dir), "config.json"), encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


MEMLOCK_MIN = 1 << 30  # bytes of locked memory below which NCCL over InfiniBand is refused (NCCL asks for unlimited)


def gloo_address_problem(environ, nodes: int, hostname: str, addresses: list[str]) -> str | None:
    """Why gloo would hang across `nodes` nodes: without GLOO_SOCKET_IFNAME it binds the address the host name
    resolves to, or the loopback address when it resolves to none; the other nodes cannot reach a loopback."""
    if nodes <= 1 or environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if addresses and not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return None
    found = f"resolves to {', '.join(sorted(addresses))}" if addresses else "does not resolve"
    return (f"this job spans {nodes} nodes and the host name {hostname!r} {found}, so gloo (the CPU groups of "
            "megatron-core and vLLM) would bind a loopback address the other nodes cannot reach and hang at "
            "start-up; set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the network interface the nodes reach "
            "each other on (`ip -br addr`)")


def memlock_problem(environ, nodes: int, memlock: int, rdma_devices: list[str], hostname: str) -> str | None:
    """Why NCCL would fail between nodes: its InfiniBand/RoCE transport registers memory with the NIC, which
    counts against RLIMIT_MEMLOCK (`memlock` bytes, resource.RLIM_INFINITY for unlimited). Pinned host memory
    (offload, vLLM's sleep) does not: the NVIDIA driver pins it without charging the limit."""
    if nodes <= 1 or not rdma_devices or environ.get("NCCL_IB_DISABLE") == "1" or \
            environ.get("NCCL_NET", "").lower() == "socket":
        return None
    if memlock == resource.RLIM_INFINITY or memlock >= MEMLOCK_MIN:
        return None
    return (f"the locked-memory limit (ulimit -l) is {memlock // 1024} KiB on {hostname}, and NCCL between this "
            f"job's {nodes} nodes uses the InfiniBand/RoCE devices {', '.join(rdma_devices)}, whose memory "
            "registration fails under a small limit ('ibv_reg_mr' / 'ibv_create_cq: Cannot allocate memory'); "
            "raise it to unlimited (Slurm: memlock unlimited for slurmd and PropagateResourceLimitsExcept=MEMLOCK), "
            "or set NCCL_IB_DISABLE=1 to run NCCL over TCP")


def _host_addresses(hostname: str) -> list[str]:
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(hostname, None)})
    except OSError:
        return []


def _raised_memlock() -> int:
    """RLIMIT_MEMLOCK after raising this process's soft limit to its hard limit (allowed to any process; the
    ranks' NCCL inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def check_host(cfg, environ=None) -> None:
    """A job over several nodes (spmdrl.dist.node.nodes_in_job): gloo's address, and on GPUs with RDMA
    devices, the locked-memory limit. One ConfigError line each."""
    from spmdrl.dist.init import resolve_device

    env = os.environ if environ is None else environ
    nodes = nodes_in_job(env)
    if nodes <= 1:
        return
    host = socket.gethostname()
    problem = gloo_address_problem(env, nodes, host, _host_addresses(host))
    if problem is None and resolve_device(cfg.trainer.device).type == "cuda":
        rdma = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
        problem = memlock_problem(env, nodes, _raised_memlock(), rdma, host)
    if problem:
        raise ConfigError(problem)


def check_reward_fns(cfg) -> None:
    """The reward functions (reward.custom_fn, reward.custom_fns) load, in a throwaway process
    (spmdrl.usercheck.check_loadable), before the ranks start: a misspelled name was found on the ranks once
    their engines were built. (The user's tools are checked the same way by config validation.)"""
    from spmdrl.usercheck import check_loadable

    r = cfg.reward
    items = [("reward.custom_fn", r.custom_fn)] if r.custom_fn else []
    check_loadable(items + [("reward.custom_fns", spec) for spec in r.custom_fns])


def check_fits(cfg, world_size: int, *, force: bool = False, device: str | None = None) -> None:
    """On CUDA (`spmdrl train` before it launches): `spmdrl plan`'s verdict for this config on `world_size` GPUs of
    this machine's memory; a config that does not fit is refused in one line unless `--force`. A plan that cannot
    be made here (a hub id not downloaded yet) is skipped with a warning: the run finds out on the GPUs."""
    from spmdrl.dist.init import resolve_device

    if force or (device or resolve_device(cfg.trainer.device).type) != "cuda":
        return
    import torch

    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        refuse_unfit(cfg, world_size, gpu_gb)
    except ConfigError as e:
        if "does not fit" in str(e):
            raise
        log.warning("the memory plan was not checked before launch (%s)", e)


def refuse_unfit(cfg, world_size: int, gpu_gb: float | None = None) -> dict:
    """The plan of `cfg` on `world_size` GPUs (of `gpu_gb` GiB each, else memory.gpu_memory_gb); a ConfigError
    naming the phase over the limit and what to change when it does not fit."""
    from spmdrl.plan import build_plan
    from spmdrl.plan.estimate import advice
    from spmdrl.plan.search import apply

    c = apply(cfg, world_size, {} if gpu_gb is None else {"memory.gpu_memory_gb": round(gpu_gb, 2)})
    p = build_plan(c, world_size)
    if not p["fits"]:
        why = "; ".join(line.strip() for line in advice(p)[:2]) or "does not fit"
        raise ConfigError(f"{why} (on {world_size} GPU(s) of {c.memory.gpu_memory_gb:g} GiB: `spmdrl plan --config F "
                          f"--world-size {world_size}` shows the whole plan); change the config, or pass --force to "
                          "start anyway")
    return p


def check_multi_turn(cfg) -> None:
    """multi_turn.enable: the tools load and the chat template renders tool conversations prefix-preserved
    (rollout/chat.py), before any engine is built."""
    if not cfg.multi_turn.enable:
        return
    from transformers import AutoTokenizer

    from spmdrl.loop.build import build_tools, tool_schemas
    from spmdrl.rollout.chat import ChatGlue

    tools = build_tools(cfg)
    path = cfg.model.tokenizer_path or cfg.model.path
    if not os.path.isdir(os.path.expanduser(path)):
        return  # a hub id: the Trainer probes the template once the snapshot is local
    tok = AutoTokenizer.from_pretrained(os.path.expanduser(path), trust_remote_code=cfg.model.trust_remote_code)
    ChatGlue(tok, tool_schemas(tools), name=path)


def resolve_total_epochs(cfg) -> str:
    """trainer.total_epochs > 0: set trainer.total_steps from the training files' row count (in place), and return
    the line that says so ('' without epochs). A trainer.total_steps set to another count as well is refused
    (the epochs used to win without a word); the count it resolves to, or the default, passes."""
    t, d = cfg.trainer, cfg.data
    if t.total_epochs <= 0:
        return ""
    from spmdrl.config.schema import TrainerConfig
    from spmdrl.data.io import count_rows

    rows = count_rows(list(d.train_files))
    per_epoch = rows // d.train_batch_size
    if per_epoch == 0:
        raise ConfigError(f"trainer.total_epochs = {t.total_epochs}: data.train_files hold {rows} rows, fewer than one "
                          f"batch of data.train_batch_size = {d.train_batch_size}; lower the batch size or add data")
    steps = t.total_epochs * per_epoch
    if t.total_steps not in (steps, TrainerConfig.total_steps):
        raise ConfigError(
            f"trainer.total_epochs = {t.total_epochs} ({steps} steps) and trainer.total_steps = {t.total_steps} are both "
            f"set; give one: trainer.total_epochs=0 to run {t.total_steps} steps, or remove trainer.total_steps (or "
            f"pass trainer.total_steps={steps}) to run {t.total_epochs} epoch(s)")
    t.total_steps = steps
    return (f"trainer.total_epochs = {t.total_epochs}: {rows} rows // data.train_batch_size {d.train_batch_size} = "
            f"{per_epoch} steps per epoch, so trainer.total_steps = {steps}")


def preflight(cfg, config_toml: str, world_size: int | None = None, *, user_code: bool = True) -> Plan:
    """Every disk and host check, in the order a user would fix them (world_size: the run's ranks, when known).
    trainer.total_epochs becomes trainer.total_steps here (resolve_total_epochs). user_code: import the reward
    functions in a throwaway process (check_reward_fns)."""
    steps_line = resolve_total_epochs(cfg)
    check_models(cfg)
    if user_code:
        check_reward_fns(cfg)
    check_multi_turn(cfg)
    check_writable(cfg.trainer.output_dir)
    plan = check_resume(cfg, config_toml, world_size)
    check_host(cfg)
    plan.steps_line = steps_line
    return plan


def clear_previous_run(plan: Plan) -> None:
    """Before a fresh run (rank 0): trainer.overwrite deletes the earlier run's checkpoints, metrics and events;
    an earlier attempt of this same run that saved no checkpoint is moved to output_dir/previous/<n>/."""
    for p in plan.clear:
        log.warning("trainer.overwrite = true: deleting %s", p)
        if os.path.isdir(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
    if plan.keep:
        previous = os.path.join(os.path.dirname(plan.keep[0]), "previous")
        n = 1 + max((int(d) for d in os.listdir(previous) if d.isdigit()), default=0) if os.path.isdir(previous) else 1
        dest = os.path.join(previous, str(n))
        os.makedirs(dest)
        for p in plan.keep:
            shutil.move(p, os.path.join(dest, os.path.basename(p)))
        log.warning("no checkpoint of this run to resume from: starting at step 0; the earlier attempt's %s moved to "
                    "%s (set checkpoint.save_freq or checkpoint.save_every_min to resume mid-run)",
                    ", ".join(os.path.basename(p) for p in plan.keep), dest)
