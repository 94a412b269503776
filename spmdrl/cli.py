"""The `spmdrl` command: launch training, inspect configs, prepare data and tiny models.

    spmdrl train --config configs/grpo.toml --nproc 8 actor.lr=2e-6
    spmdrl eval --config configs/grpo.toml --checkpoint outputs/run
    spmdrl config show --config configs/grpo.toml --world-size 8
    spmdrl config from-verl actor_rollout_ref.actor.optim.lr=1e-6 trainer.total_epochs=15
    spmdrl data synthetic --out data/arith
    spmdrl model tiny --out models/tiny
    spmdrl sweep plan|run|report configs/ablations/estimators.toml
    spmdrl plan --config configs/ppo_70b.toml --json
    spmdrl plan --config configs/grpo.toml --min-gpus

Every SpmdrlError (bad config, data, path) prints as one line `error: ...` on stderr with exit code 2.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Optional

import typer

from spmdrl.errors import SpmdrlError

class _Command(typer.Typer):
    """The `spmdrl` console script: it leaves without the interpreter's teardown (spmdrl.process.launcher.leave), which
    takes seconds once a command has imported torch and vLLM."""

    def __call__(self, *args, **kwargs):
        from spmdrl.process.launcher import leave

        try:
            super().__call__(*args, **kwargs)
        except SystemExit as e:
            leave(e.code)
        leave(0)


app = _Command(
    name="spmdrl",
    help="SPMD RL post-training for LLMs (PPO, GRPO and family) under torchrun.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
config_app = typer.Typer(help="Inspect the resolved config and regenerate its reference.", no_args_is_help=True)
data_app = typer.Typer(help="Write datasets in verl's parquet schema.", no_args_is_help=True)
model_app = typer.Typer(help="Build local models.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")
app.add_typer(model_app, name="model")

# Overrides look like options to click (`--actor.lr=1e-6`); let them through to the OVERRIDES argument.
PASS_OVERRIDES = {"ignore_unknown_options": True}
CONFIG_HELP = "TOML config file (may `extends` others)."
OVERRIDES_HELP = "Config overrides `section.key=value` (e.g. actor.lr=1e-6 rollout.n=8); last one wins."


def user_errors(fn):
    """Print SpmdrlError as one line `error: ...` on stderr and exit 2, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpmdrlError as e:
            typer.echo(f"error: {' '.join(str(e).splitlines())}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _overrides(items: Optional[list[str]]) -> list[str]:
    return [o[2:] if o.startswith("--") else o for o in items or []]


def launch_command(module: str, config: str, overrides: list[str], nproc: int) -> list[str]:
    """The command that runs `module` on `nproc` local ranks (spmdrl.process.launcher: torchrun, when nproc > 1)."""
    from spmdrl.process.launcher import launch_command as command

    return command(module, config, overrides, nproc)


_exec = os.execve  # replaced in tests


def _launch(cmd: list[str], dry_run: bool, verbosity: str = "info") -> None:
    """Become the launcher (exec, no parent left behind): a signal to this PID reaches torchrun's agent, which
    stops every rank; safe-path mode (PYTHONSAFEPATH) reaches the ranks through the environment. At
    logging.verbosity info, torch's C++ warnings (vLLM's NUMA binding notice on every rank) are left out
    (TORCH_CPP_LOG_LEVEL=ERROR, read once when torch loads; a value set by the user is kept)."""
    typer.echo(" ".join(cmd), err=True)
    if dry_run:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if (os.environ.get("SPMDRL_VERBOSITY") or verbosity) != "debug":
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    _exec(cmd[0], cmd, env)


def _validate_and_launch(module, config, overrides, nproc, dry_run, root_cls, validate_fn, preflight_fn=None) -> None:
    """Load and validate the config for `nproc` ranks, run the checks on disk (errors before any process
    starts), then launch."""
    from spmdrl.config import load_config

    overrides = _overrides(overrides)
    cfg = load_config(config, overrides, root_cls=root_cls)
    _quiet(cfg)
    validate_fn(cfg, nproc)
    if preflight_fn is not None and preflight_fn(cfg, nproc) is False:
        return
    _launch(launch_command(module, config, overrides, nproc), dry_run, cfg.logging.verbosity)


def _quiet(cfg) -> None:
    """logging.verbosity in this process as on the ranks (spmdrl.train.apply_verbosity): the checks import vLLM,
    which would print its Triton notice here."""
    from spmdrl.train import apply_verbosity

    apply_verbosity(cfg.logging.verbosity)


def _train_preflight(cfg, nproc: int, force: bool = False):
    """spmdrl.preflight before launching, and on CUDA the memory plan's verdict (--force: not); False (and one
    line) when the run is already at total_steps."""
    from spmdrl.config import to_toml
    from spmdrl.preflight import check_fits, preflight

    plan = preflight(cfg, to_toml(cfg), world_size=nproc)
    check_fits(cfg, nproc, force=force)
    if plan.resume and plan.resume_step >= cfg.trainer.total_steps:
        typer.echo(f"{plan.resume} is at step {plan.resume_step} and trainer.total_steps = {cfg.trainer.total_steps}: "
                   "nothing to train (raise trainer.total_steps to go on)", err=True)
        return False
    return plan


@app.command(context_settings=PASS_OVERRIDES)
@user_errors
def train(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    nproc: int = typer.Option(1, "--nproc", "-n", min=1, help="Ranks on this machine; > 1 launches torchrun."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the config and print the command; run nothing."),
    force: bool = typer.Option(False, "--force", help="On CUDA: start even when `spmdrl plan` says the config does "
                               "not fit the GPUs' memory."),
):
    """RL training (python -m spmdrl.train), on --nproc local ranks.

    The config is validated for --nproc ranks before any process starts; on CUDA, a config that `spmdrl plan`
    says does not fit is refused unless --force.

    Several nodes: run `torchrun ... -m spmdrl.train --config F` on each.
    """
    from spmdrl.config import Config, validate

    _validate_and_launch("spmdrl.train", config, overrides, nproc, dry_run, Config, validate,
                         functools.partial(_train_preflight, force=force))


@app.command(context_settings=PASS_OVERRIDES)
@user_errors
def sft(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    nproc: int = typer.Option(1, "--nproc", "-n", min=1, help="Ranks on this machine; > 1 launches torchrun."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the command; run nothing."),
):
    """Supervised warm start (python -m spmdrl.sft) on the same training engines, on --nproc local ranks.

    The config is validated for --nproc ranks before any process starts.
    """
    from spmdrl.sft import SFTConfig, validate_sft

    _validate_and_launch("spmdrl.sft", config, overrides, nproc, dry_run, SFTConfig, validate_sft)


@app.command("eval", context_settings=PASS_OVERRIDES)
@user_errors
def eval_(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    checkpoint: Optional[str] = typer.Option(
        None, "--checkpoint", help="Evaluate this checkpoint (or a run's output_dir: its latest) instead of model.path; "
        "its policy is exported to <out>/model first (a LoRA one merged)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Where eval.json and generations.jsonl go; default "
                                      "<run>/eval with --checkpoint (the run that wrote the checkpoint), else "
                                      "<trainer.output_dir>/eval."),
    nproc: int = typer.Option(1, "--nproc", "-n", min=1, help="Ranks on this machine; > 1 launches torchrun."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the config and print the command; run nothing."),
):
    """Validation only (python -m spmdrl.evaluate): the model's accuracy per data source on data.val_files, with
    the run's rollout engine, rollout.val_* sampling and reward; no training engine is built (verl's
    trainer.val_only). Prints the accuracies and writes <out>/eval.json; logging.log_generations=N also writes N
    samples to <out>/generations.jsonl. With --checkpoint, <out> defaults to the checkpoint's run: <run>/eval."""
    from spmdrl.config import load_config
    from spmdrl.evaluate import EVAL_FILE, validate_eval
    from spmdrl.preflight import check_models

    overrides = _overrides(overrides)
    cfg = load_config(config, overrides)
    _quiet(cfg)
    path = None
    if checkpoint:
        from spmdrl.checkpoint import find_checkpoint

        path = find_checkpoint(checkpoint)
    out = os.path.abspath(out or os.path.join(run_of(path) if path else cfg.trainer.output_dir, "eval"))
    extra = [f"trainer.output_dir={out}"]
    if path:
        from spmdrl.checkpoint import read_manifest

        model = os.path.join(out, "model")
        extra += [f"model.path={model}", "model.tokenizer_path=", "lora.enable=false"]
        if not dry_run:
            import shutil

            from spmdrl.export import export_hf

            shutil.rmtree(model, ignore_errors=True)  # the export of an earlier evaluation in this directory
            lora = "adapter" in read_manifest(path)["engines"].get("actor", {})
            typer.echo(f"exporting {path} to {model}", err=True)
            export_hf(path, model, merged=lora)
    overrides += extra
    cfg = load_config(config, overrides)
    if not dry_run or not checkpoint:
        validate_eval(cfg, nproc)
        check_models(cfg)
    for name in (EVAL_FILE, "generations.jsonl", "metrics.jsonl"):  # this directory holds one evaluation
        if not dry_run and os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    _launch(launch_command("spmdrl.evaluate", config, overrides, nproc), dry_run, cfg.logging.verbosity)


def run_of(checkpoint: str) -> str:
    """The output_dir of the run that wrote `checkpoint` (<run>/checkpoints/step_N), or the checkpoint's parent
    directory for one kept elsewhere."""
    from spmdrl.checkpoint.files import checkpoint_root

    parent = os.path.dirname(os.path.abspath(checkpoint))
    run = os.path.dirname(parent)
    return run if os.path.abspath(checkpoint_root(run)) == parent else parent


@config_app.command("show", context_settings=PASS_OVERRIDES)
@user_errors
def config_show(
    config: Optional[str] = typer.Option(None, "--config", "-c", help=CONFIG_HELP + " Omit for the defaults."),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    world_size: Optional[int] = typer.Option(
        None, "--world-size", "-w", min=1, help="Validate for this many ranks (default: the fewest the [placement] "
        "allows) and print the layout on stderr."
    ),
    comments: bool = typer.Option(False, "--comments", help="Put each key's documentation above it."),
    sft: bool = typer.Option(False, "--sft", help="An SFT config (`spmdrl sft`); a file with an [sft] table is one anyway."),
):
    """Print the resolved config (files, extends and overrides merged) as TOML, valid input to --config.

    A config file or overrides are validated first (for --world-size ranks, else the fewest the [placement]
    allows; wandb/MLflow are not checked): an invalid value is a one-line error, exit 2. The defaults alone are
    printed without validation (they name no model)."""
    from spmdrl.config import load_config, to_toml, validate
    from spmdrl.config.loader import read_toml_tree
    from spmdrl.config.schema import Config, SFTConfig
    from spmdrl.dist.layout import smallest_world

    overrides = _overrides(overrides)
    sft = sft or any(o.startswith("sft.") for o in overrides) or bool(config and "sft" in read_toml_tree(config)[0])
    cfg = load_config(config, overrides, root_cls=SFTConfig if sft else Config)
    if world_size is not None or config or overrides:
        from spmdrl.dist.layout import role_backends

        world = world_size or smallest_world(cfg.placement, None if sft else role_backends(cfg))
        if sft:
            from spmdrl.sft import validate_sft

            layout = validate_sft(cfg, world)
        else:
            layout = validate(cfg, world, trackers=False)
    if world_size is not None:
        for role in layout.values():
            typer.echo(f"# {role.role}: {len(role.ranks)} ranks, dp={role.dp} pp={role.pp} tp={role.tp}", err=True)
    typer.echo(to_toml(cfg, with_docs=comments), nl=False)


@config_app.command("from-verl", context_settings=PASS_OVERRIDES)
@user_errors
def config_from_verl(
    args: Optional[list[str]] = typer.Argument(None, help="verl's command line or its Hydra overrides "
                                               "(actor_rollout_ref.actor.optim.lr=1e-6 ...); later ones win.",
                                               show_default=False),
    yaml_file: Optional[str] = typer.Option(None, "--yaml", help="A verl config YAML (ppo_trainer.yaml style), read "
                                            "before the overrides."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Write the TOML here instead of stdout."),
):
    """Convert a verl run (command line and/or YAML) into an spmdrl TOML config, with what could not be converted
    as comments at the top (docs/verl.md has the key map)."""
    from spmdrl.config.docs import converted_toml
    from spmdrl.config.verl import from_verl

    text = converted_toml(*from_verl(list(args or []), yaml_file))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        typer.echo(f"wrote {out}; check it with `spmdrl config show --config {out}`")
    else:
        typer.echo(text, nl=False)


@config_app.command("docs")
@user_errors
def config_docs(
    out: str = typer.Option("docs/config.md", "--out", "-o", help="Where to write the reference; '-' for stdout."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if the file is stale."),
):
    """Regenerate the config reference (docs/config.md) from the dataclasses and their field docstrings."""
    from spmdrl.config import config_reference

    text = config_reference()
    if out == "-":
        typer.echo(text, nl=False)
    elif check:
        current = open(out, encoding="utf-8").read() if os.path.exists(out) else None
        if current != text:
            typer.echo(f"{out} is stale; run `spmdrl config docs --out {out}`", err=True)
            raise typer.Exit(1)
    else:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        typer.echo(f"wrote {out}")


@data_app.command("gsm8k")
@user_errors
def data_gsm8k(
    input: str = typer.Option(..., "--input", "-i", help="A GSM8K .parquet/.jsonl file, or a directory of train/test files."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory for {split}.parquet."),
):
    """Convert the original GSM8K files to verl-schema parquet (train.parquet, test.parquet)."""
    from spmdrl.data.gsm8k import convert_gsm8k

    for split, path in convert_gsm8k(input, out).items():
        typer.echo(f"{split}: {path}")


@data_app.command("synthetic")
@user_errors
def data_synthetic(
    out: str = typer.Option(..., "--out", "-o", help="Output directory."),
    n_train: int = typer.Option(4096, "--n-train", min=1, help="Training problems."),
    n_val: int = typer.Option(256, "--n-val", min=0, help="Validation problems (disjoint from training)."),
    n_sft: Optional[int] = typer.Option(
        None, "--n-sft", min=1, help="Rows of sft.parquet (from the training side); default --n-train."
    ),
    seed: int = typer.Option(0, "--seed", help="The files are a function of the seed."),
    digits: int = typer.Option(2, "--digits", min=1, help="Digits per operand."),
    ops: str = typer.Option("+", "--ops", help="Operators to draw from, e.g. '+-'."),
):
    """Write the synthetic arithmetic task ("12+34=" -> "46"): train/val.parquet and sft.parquet."""
    from spmdrl.data.synthetic import make_arith, make_sft_parquet

    paths = make_arith(out, n_train=n_train, n_val=n_val, seed=seed, digits=digits, ops=ops)
    paths["sft"] = make_sft_parquet(out, n=n_sft or n_train, n_val=n_val, seed=seed, digits=digits, ops=ops)
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")


@data_app.command("count-shapes")
@user_errors
def data_count_shapes(
    out: str = typer.Option(..., "--out", "-o", help="Output directory."),
    n_train: int = typer.Option(1024, "--n-train", min=1, help="Training pictures."),
    n_val: int = typer.Option(64, "--n-val", min=0, help="Validation pictures."),
    seed: int = typer.Option(0, "--seed", help="The files are a function of the seed."),
    max_count: int = typer.Option(4, "--max-count", min=1, max=16, help="Most shapes in a picture."),
    size: int = typer.Option(56, "--size", min=16, help="Picture side in pixels."),
    n_sft: int = typer.Option(0, "--n-sft", min=0, help="Rows of sft.parquet (prompt, response, images); 0: none."),
):
    """Write the synthetic image task (pictures of 1..max-count shapes, "How many shapes?") as verl multimodal
    parquet (train.parquet, val.parquet, and with --n-sft sft.parquet for `spmdrl sft`), for vision-language
    models."""
    from spmdrl.data.count_shapes import make_count_shapes

    for split, path in make_count_shapes(out, n_train=n_train, n_val=n_val, seed=seed, max_count=max_count,
                                         size=size, n_sft=n_sft).items():
        typer.echo(f"{split}: {path}")


@data_app.command("geo3k")
@user_errors
def data_geo3k(
    input: str = typer.Option(..., "--input", "-i", help="A Geometry3K .parquet/.jsonl file, or a directory of "
                              "train/validation/test files (or with them in data/, as the hub's snapshot has)."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory for {split}.parquet."),
):
    """Convert a geometry-QA dataset in Geometry3K's layout (problem, answer, images) to verl's multimodal parquet,
    for vision-language models (docs/vlm.md)."""
    from spmdrl.data.geo3k import convert_geo3k

    for split, path in convert_geo3k(input, out).items():
        typer.echo(f"{split}: {path}")


@data_app.command("tool-sums")
@user_errors
def data_tool_sums(
    out: str = typer.Option(..., "--out", "-o", help="Output directory."),
    n_train: int = typer.Option(4096, "--n-train", min=1, help="Training problems."),
    n_val: int = typer.Option(256, "--n-val", min=0, help="Validation problems (disjoint from training)."),
    n_sft: Optional[int] = typer.Option(
        None, "--n-sft", min=1, help="Conversations in sft.parquet (from the training side); default --n-train."
    ),
    seed: int = typer.Option(0, "--seed", help="The files are a function of the seed."),
    min_terms: int = typer.Option(2, "--min-terms", help="Fewest numbers per sum."),
    max_terms: int = typer.Option(3, "--max-terms", help="Most numbers per sum."),
    min_digits: int = typer.Option(5, "--min-digits", help="Fewest digits per number."),
    max_digits: int = typer.Option(7, "--max-digits", help="Most digits per number."),
):
    """Write the calculator task ("1234567+89012=" -> "1323579", too long to add without the tool):
    train/val.parquet and sft.parquet (tool-call demonstrations as whole conversations)."""
    from spmdrl.data.tool_sums import make_tool_sums

    paths = make_tool_sums(out, n_train=n_train, n_val=n_val, n_sft=n_sft, seed=seed, terms=(min_terms, max_terms),
                           digits=(min_digits, max_digits))
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")


@model_app.command("tiny")
@user_errors
def model_tiny(
    out: str = typer.Option(..., "--out", "-o", help="Output HF model directory."),
    seed: int = typer.Option(0, "--seed", help="Initialisation seed."),
    arch: str = typer.Option("qwen2", "--arch", help="Architecture: llama, qwen2, qwen3, mistral, gemma3, mixtral, "
                             "qwen3_moe, qwen2_moe, phi3 or falcon (sizes chosen by hand), qwen2_5_vl or qwen3_vl (vision-language, with "
                             "an image processor), or any other model type "
                             "transformers knows (its published defaults scaled down)."),
):
    """Build a tiny random model (Qwen2 by default, the quickstart's) with the byte-level tokenizer, for smoke
    tests of an architecture."""
    from spmdrl.errors import ConfigError, summary
    from spmdrl.tiny import ARCHS, build_any, build_tiny

    if arch in ARCHS:
        typer.echo(build_tiny(out, seed=seed, arch=arch))
        return
    try:
        typer.echo(build_any(out, arch, seed=seed))
    except Exception as e:  # noqa: BLE001 - transformers' own reason, in one line
        raise ConfigError(f"--arch {arch!r}: cannot build a tiny instance ({summary(e, width=200)})") from None


@model_app.command("sweep")
@user_errors
def model_sweep(
    out: str = typer.Option("outputs/model_sweep", "--out", "-o", help="Output directory (models, runs, results)."),
    arch: Optional[list[str]] = typer.Option(None, "--arch", help="A model type, or type@key=value,... (with config "
                                             "overrides); repeat it. Default: every architecture."),
    docs: Optional[str] = typer.Option(None, "--docs", help="Write the table into this file's generated block "
                                       "(docs/models.md)."),
    list_only: bool = typer.Option(False, "--list", help="Print the architectures and exit."),
):
    """Every decoder architecture both transformers and vLLM register, as a tiny random model through 2 GRPO
    steps (2 processes, vLLM at rollout TP 2): trains, refused (one line), stopped, crashed or unbuildable."""
    import json

    from spmdrl.model_sweep import architectures, sweep, table, write_docs

    if list_only:
        for model_type, cls in architectures().items():
            typer.echo(f"{model_type}\t{cls}")
        return
    results = sweep(out, arch or None)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results)
    typer.echo(text)
    if docs:
        write_docs(docs, text)


@app.command(context_settings=PASS_OVERRIDES)
@user_errors
def bench(
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP),
    nproc: int = typer.Option(2, help="Local ranks (torchrun)."),
    steps: int = typer.Option(12, help="RL steps to run; the first 2 are warm-up and not measured."),
    model: Optional[str] = typer.Option(None, help="HF model directory; default: a freshly built tiny model."),
    work_dir: str = typer.Option("outputs/bench", help="Where the data, model and run go."),
    compare_placements: bool = typer.Option(False, "--placements", help="Run colocated, split (max_staleness 0) and "
                                            "split (max_staleness 1) on the same workload and world; one row each."),
    compare_lora: bool = typer.Option(False, "--lora", help="Run a LoRA actor with rollout.lora_sync adapter and merge "
                                      "on the same workload and world; one row each."),
    compare_async: bool = typer.Option(False, "--async", help="Run colocated synchronous, split max_staleness 1, "
                                       "asynchronous split (rollout.partial) and colocated partial rollouts on a "
                                       "long-tail workload; one row each over the same number of trained tokens: "
                                       "trained tokens/s, busy %, version lag, response lengths."),
    tokens: Optional[float] = typer.Option(None, help="--async: the trained tokens each mode is measured over "
                                           "(default: the fewest any mode trained in its measured steps)."),
    warmup: Optional[int] = typer.Option(None, help="--async: steps not measured at the start (default: a quarter "
                                         "of --steps, at least 2)."),
    baseline: Optional[str] = typer.Option(None, help="--async: a git revision of this checkout (e.g. main) whose "
                                           "code also runs (a) and (b), as rows '(base)'."),
    tools: bool = typer.Option(False, "--tools", help="Run the multi-turn turn loop on the calculator task (the tool "
                               "quickstart's GRPO; --model: its SFT model, default: trained once into the work dir) and "
                               "report the loop's time split: generation, tools, idle, turns, model tokens/s."),
):
    """Time a GRPO step by stage on the quickstart setup and report the SPMD overhead."""
    from spmdrl.bench import (
        async_bench, breakdown, format_breakdown, launch, lora_bench, placement_bench, prepare, tool_bench,
    )

    if compare_async:
        typer.echo(async_bench(work_dir, model, nproc, steps, _overrides(overrides), tokens, warmup, baseline))
        return
    if tools:
        typer.echo(tool_bench(work_dir, model, nproc, steps, _overrides(overrides)))
        return
    if compare_lora:
        typer.echo(lora_bench(work_dir, model, nproc, steps, _overrides(overrides)))
        return
    if compare_placements:
        typer.echo(placement_bench(work_dir, model, nproc, steps, _overrides(overrides)))
        return
    model_dir, data = prepare(work_dir, model)
    run_dir = launch(work_dir, model_dir, data, nproc, steps, _overrides(overrides))
    typer.echo(format_breakdown(breakdown(run_dir)))


@app.command(context_settings=PASS_OVERRIDES)
@user_errors
def plan(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    overrides: Optional[list[str]] = typer.Argument(None, help=OVERRIDES_HELP, show_default=False),
    world_size: Optional[int] = typer.Option(None, "--world-size", "-w", min=1, help="Ranks; default memory.nodes x memory.gpus_per_node."),
    gpu_gb: Optional[float] = typer.Option(None, "--gpu-gb", help="GPU memory per device in GiB (memory.gpu_memory_gb)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="memory.gpus_per_node."),
    host_gb: Optional[float] = typer.Option(None, "--host-gb", help="Host memory per node in GiB (memory.host_memory_gb)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of the table."),
    sizes: bool = typer.Option(False, "--sizes", help="Also: which Qwen2.5 sizes (0.5B-72B) fit this workload on one "
                               "GPU, full fine-tuning next to LoRA (lora, else rank 32 on every linear)."),
    min_gpus: bool = typer.Option(False, "--min-gpus", help="Search the smallest GPU count that fits (1, 2, 4, ... "
                                  "then whole nodes; on each the config's tensor and pipeline parallelism, then larger "
                                  "(pp on Megatron only), each without and with the training state offloaded; stderr "
                                  "lists each candidate, skipped ones with the reason) and plan that layout; slow for "
                                  "large models."),
    max_gpus: int = typer.Option(1024, "--max-gpus", min=1, help="With --min-gpus: search no further than this."),
):
    """Role meshes, weight-sync bytes and memory per phase for a config; no GPU, no weights (spmdrl/plan/).
    Trackers (wandb, MLflow) are not checked: a plan starts no run. Exit 1 when the plan does not fit."""
    import json

    from spmdrl.config import load_config, validate
    from spmdrl.plan import build_plan, render
    from spmdrl.plan.search import apply

    extra = [f"memory.{k}={v}" for k, v in (("gpu_memory_gb", gpu_gb), ("gpus_per_node", gpus_per_node),
                                            ("host_memory_gb", host_gb)) if v is not None]
    cfg = load_config(config, _overrides(overrides) + extra)
    _quiet(cfg)
    if min_gpus:
        from spmdrl.errors import ConfigError
        from spmdrl.plan.search import format_change, min_gpus as search

        found = search(cfg, max_gpus, note=lambda line: typer.echo(f"# {'' if ': skipped, ' in line else 'tried '}"
                                                                   f"{line}", err=True))
        if found is None:
            raise ConfigError(f"no layout of up to {max_gpus} GPUs fits this config; see `spmdrl plan` without "
                              "--min-gpus for what does not fit")
        world, change, p = found
        typer.echo(f"smallest layout that fits: {world} GPU(s)" + (f" with {format_change(change)}" if change else
                                                                     " as configured"), err=True)
    else:
        world = world_size or cfg.memory.nodes * cfg.memory.gpus_per_node
        cfg = apply(cfg, world, {}) if world_size else cfg  # the header says the hardware of --world-size
        validate(cfg, world, trackers=False)
        p = build_plan(cfg, world)
    if sizes:
        from spmdrl.plan.sizes import fit_table, render_fit_table

        rows = fit_table(cfg)
        p["one_gpu_sizes"] = rows
    typer.echo(json.dumps(p, indent=1) if as_json else render(p) + (
        "\n\n" + render_fit_table(rows, cfg.memory.gpu_memory_gb) if sizes else ""))
    if not p["fits"]:
        raise typer.Exit(1)


@app.command()
@user_errors
def summary(run_dirs: list[str] = typer.Argument(..., help="Run output directories (trainer.output_dir).")):
    """Print a table of a run's headline metrics (validation accuracy, reward, step time, throughput)."""
    from spmdrl.errors import DataError
    from spmdrl.metrics import format_table, summarize_run

    rows = []
    for d in run_dirs:
        if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
            raise DataError(f"{d}: no metrics.jsonl; give a run's trainer.output_dir")
        rows.append((os.path.basename(os.path.normpath(d)), summarize_run(d)))
    typer.echo(format_table(rows))


sweep_app = typer.Typer(help="Ablation sweeps: a base config and axes of overrides, one run per point.", no_args_is_help=True)
app.add_typer(sweep_app, name="sweep")
SWEEP_HELP = "Sweep file (TOML: base, output_dir, nproc, mode, overrides, seeds, [axes]); see docs/sweeps.md."
SWEEP_NPROC_HELP = "Ranks per run; overrides the sweep file's nproc."


@sweep_app.command("plan")
@user_errors
def sweep_plan(
    sweep_file: str = typer.Argument(..., help=SWEEP_HELP),
    nproc: Optional[int] = typer.Option(None, "--nproc", "-n", min=1, help=SWEEP_NPROC_HELP),
    slurm: bool = typer.Option(False, "--slurm", help="Validate for the Slurm world size (nproc * slurm.nodes)."),
):
    """List the runs (name, state, overrides); every run's config is loaded and validated."""
    from spmdrl.sweep import format_plan, load_sweep

    typer.echo(format_plan(load_sweep(sweep_file, nproc, slurm=slurm)))


@sweep_app.command("run")
@user_errors
def sweep_run(
    sweep_file: str = typer.Argument(..., help=SWEEP_HELP),
    nproc: Optional[int] = typer.Option(None, "--nproc", "-n", min=1, help=SWEEP_NPROC_HELP),
    slurm: bool = typer.Option(False, "--slurm", help="Write slurm/sweep_<name>.sbatch (an array, one task per unfinished run) and print the sbatch command; run nothing."),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop at the first failed run (default: go on, report failures at the end)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print each unfinished run's command; run nothing."),
    stream: bool = typer.Option(False, "--stream", help="Echo each run's output here too (it always goes to <run dir>/launch.log)."),
):
    """Run the sweep's unfinished runs one after another (torchrun each), skipping finished ones.

    Everything is validated before the first run starts. A run is finished when its metrics.jsonl ends at
    trainer.total_steps; a partial run resumes (checkpoint.resume=auto). Exit 1 when a run failed.
    """
    from spmdrl.sweep import load_sweep, run_local, write_slurm

    sweep = load_sweep(sweep_file, nproc, slurm=slurm)
    if slurm:
        path, todo = write_slurm(sweep)
        if path is None:
            typer.echo(f"all {len(sweep.runs)} runs are finished; nothing to submit")
        else:
            typer.echo(f"wrote {path}: {len(todo)} of {len(sweep.runs)} runs ({len(sweep.runs) - len(todo)} finished)")
            typer.echo(f"sbatch {path}")
        return
    failed = run_local(sweep, fail_fast=fail_fast, dry_run=dry_run, stream=stream, echo=typer.echo,
                       launch_command=launch_command)
    if failed:
        typer.echo(f"{len(failed)} of {len(sweep.runs)} runs failed: "
                   + ", ".join(f"{r.name} (exit {rc}, log {r.output_dir}/launch.log)" for r, rc in failed), err=True)
        raise typer.Exit(1)
    if not dry_run:
        typer.echo(f"all {len(sweep.runs)} runs finished; `spmdrl sweep report {sweep_file}` compares them")


@sweep_app.command("report")
@user_errors
def sweep_report(
    sweep_file: str = typer.Argument(..., help=SWEEP_HELP),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Where the PNG plots go; default <output_dir>/report."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write reward.png and val_accuracy.png."),
):
    """Compare the runs: a table (final and best val accuracy, reward, step time, tokens/s) and PNG curves."""
    from spmdrl.sweep import format_report, load_sweep, summaries, write_plots

    sweep = load_sweep(sweep_file)
    typer.echo(format_report(sweep, summaries(sweep)))
    if plots:
        for path in write_plots(sweep, out or os.path.join(sweep.output_dir, "report")):
            typer.echo(f"wrote {path}")


@app.command()
@user_errors
def export(
    checkpoint: str = typer.Option(
        ..., "--checkpoint", help="A checkpoint directory, or a run's output_dir (its latest checkpoint)."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output HF model directory (safetensors, config, tokenizer)."),
    dtype: str = typer.Option(
        "auto", "--dtype", help="auto (the original model's dtype) | float32 | bfloat16 | float16."
    ),
    merged: bool = typer.Option(
        False, "--merged", help="LoRA checkpoints: write the base model with the adapters merged in, not the adapters."
    ),
):
    """Write a checkpoint's actor (the policy) as an HF model directory (a LoRA run's: a PEFT adapter directory,
    or with --merged the merged model); one plain process, no torchrun."""
    from spmdrl.export import export_hf

    typer.echo(export_hf(checkpoint, out, dtype=dtype, merged=merged))


@app.command()
@user_errors
def serve(
    checkpoint: str = typer.Option(..., "--checkpoint", help="A checkpoint directory, a run's output_dir (its latest "
                                   "checkpoint) or an HF model directory."),
    port: int = typer.Option(8000, "--port", help="Port on 127.0.0.1 (loopback only)."),
    export_to: Optional[str] = typer.Option(None, "--export-to", help="Where a checkpoint is exported first "
                                            "(default <the checkpoint's run>/serve_model, replaced)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (agents' values are ignored)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus threshold (agents' values are ignored)."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Longest completion; an agent's max_tokens may lower it."),
    max_model_len: int = typer.Option(4096, "--max-model-len", help="Prompt + completion, in tokens."),
    engine: str = typer.Option("auto", "--engine", help="vllm | hf | auto."),
):
    """An OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, /v1/models) for a trained model, the one
    agent rollouts train through, without capture (docs/agents.md). The API key is SPMDRL_SERVE_KEY, or a random
    one printed at start."""
    import secrets as _secrets

    from spmdrl.rollout import SamplingSpec
    from spmdrl.serve import model_dir, serve_model

    key = os.environ.get("SPMDRL_SERVE_KEY") or _secrets.token_urlsafe(24)
    model = model_dir(checkpoint, export_to)
    spec = SamplingSpec(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    spec.validate()

    def ready(url):
        typer.echo(f"serving {model}\nOPENAI_BASE_URL={url}\nOPENAI_API_KEY={key}", err=True)

    serve_model(model, secret=key, port=port, spec=spec, max_model_len=max_model_len, engine_kind=engine, on_ready=ready)


def main() -> None:
    app(prog_name="spmdrl")


__all__ = ["app", "launch_command", "main"]
