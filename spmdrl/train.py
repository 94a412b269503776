"""Entry point: `torchrun --nproc-per-node N -m spmdrl.train --config F.toml [section.key=value ...]`.

Also runs as plain `python -m spmdrl.train ...` (a world of one) and under `srun` without torchrun.
Config errors and the checks on disk (spmdrl.preflight) are raised on every rank before any process group,
model or engine exists; every error is one line, printed once (spmdrl.process.launcher.report_error), exit 2.
"""
import os
import sys

if __name__ == "__main__" and not sys.flags.safe_path:
    # `python -m` put the working directory first on sys.path: take it off before any other import, so a
    # file there (./tomllib.py, ./logging.py) cannot shadow a module (`spmdrl train` runs ranks with -P)
    _cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != _cwd]

import argparse
import logging
import signal

from spmdrl.errors import SpmdrlError


# Python warnings from these modules carry nothing a user acts on; logging.verbosity = "debug" shows them
QUIET_WARNINGS = r"(vllm|triton|megatron|transformer_engine|torch\.distributed\.checkpoint|torch\._dynamo)(\.|$)"


RESOURCE_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[%(asctime)s rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )


def apply_verbosity(level: str) -> None:
    """logging.verbosity (SPMDRL_VERBOSITY wins): info quiets the libraries' routine output, debug shows all.
    Also run by the `spmdrl` command once it has read the config, since its checks import vLLM. Runs before vLLM is
    imported (it reads VLLM_LOGGING_LEVEL once, at import); a VLLM_LOGGING_LEVEL set by the
    user is kept."""
    import warnings

    level = os.environ.get("SPMDRL_VERBOSITY") or level
    if level == "debug":
        for name in ("vllm", "transformers", "torch.distributed", "httpx", "megatron"):
            logging.getLogger(name).setLevel(logging.NOTSET)
        warnings.filterwarnings("default", module=QUIET_WARNINGS)
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs every engine call at INFO
    for name in ("transformers", "torch.distributed", "httpx", "megatron"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # a tracker's retries: its failure is one line of its own
    # Python's resource tracker (a process of its own, started by vLLM's shared-memory queues, which inherits this
    # environment) warns at exit about the segments it cleans up for vLLM: "leaked shared_memory objects"
    if RESOURCE_TRACKER_QUIET not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), RESOURCE_TRACKER_QUIET) if w)
    # vLLM's own handler takes VLLM_LOGGING_LEVEL; what it logs before that is set up reaches the root logger
    logging.getLogger("vllm").setLevel(logging.getLevelName(os.environ["VLLM_LOGGING_LEVEL"].upper()))
    warnings.filterwarnings("ignore", module=QUIET_WARNINGS)


def run_entry(argv, *, prog: str, description: str, root_cls, validate_fn, run_fn, preflight_fn=None) -> int:
    """The shared shape of an entry point: parse, load + validate the config and preflight_fn(cfg) (before
    any process group; the first rank to find an error prints it), init dist, run_fn(cfg, layout, env, device, plan),
    tear down. SIGTERM/SIGINT stop it with one line; the rank leaves when its launcher dies. Exit 2 on a
    user error, 128 + the signal on a stop (143 for SIGTERM, 130 for Ctrl-C)."""
    from spmdrl.faults import (STOP_GRACE_S, Stopped, Terminated, ignore_stop_signals, slow_start_if_injected,
                               stop_handled, stop_signals, watch_stop_signals)
    from spmdrl.process.launcher import record_bug, report_error, settle_heap, watch_parent

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", "-c", default=None, help="TOML config file")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = p.parse_args(argv)
    from spmdrl.config.loader import load_config
    from spmdrl.dist.init import destroy_distributed, detect_env, init_distributed
    from spmdrl.dist.layout import is_split

    env = detect_env()
    setup_logging(env.rank)
    watchers = [watch_parent(), watch_stop_signals(lambda signum: report_error(
        f"stopped by {signal.Signals(signum).name}; the rank was blocked in a call that does not return to Python "
        f"(waiting for a peer that died?) and left after {STOP_GRACE_S:g}s; relaunch the same command to resume from "
        "the last complete checkpoint, if one was saved", env.rank))]
    try:
        with stop_signals():
            try:
                slow_start_if_injected(env.rank)
                cfg = load_config(args.config, args.overrides, root_cls=root_cls)
                _absolute_output_dir(cfg)
                apply_verbosity(cfg.logging.verbosity)
                layout = validate_fn(cfg, env.world_size)
                plan = preflight_fn(cfg, env.rank, env.world_size) if preflight_fn else None
                settle_heap()
            except SpmdrlError as e:  # every rank finds it; the first to get here says it (the others may be stopped)
                report_error(e, env.rank)
                return 2
            except Terminated as e:
                stop_handled()
                ignore_stop_signals()
                report_error(_stopped(e, "before start-up"), env.rank)
                return 128 + e.signum
            if plan is False:  # nothing to do (said so)
                return 0
            try:
                env, device = init_distributed(cfg.trainer.device, cfg.trainer.dist_timeout_s, split=is_split(layout))
                logging.getLogger("spmdrl").info("%s: %d rank(s) via %s on %s; output %s", prog, env.world_size,
                                                 env.launcher, device.type, cfg.trainer.output_dir)
                run_fn(cfg, layout, env, device)
            except SpmdrlError as e:  # a stop (Stopped) is not a user error: 128 + the signal, as a shell reports it
                if isinstance(e, Stopped):
                    ignore_stop_signals()
                report_error(e, env.rank)
                code = 128 + e.signum if isinstance(e, Stopped) else 2
                _exit_now_if_stopped(code, isinstance(e, Stopped))
                return code
            except Terminated as e:
                stop_handled()
                ignore_stop_signals()
                report_error(_stopped(e, "while starting (loading models, building engines)"), env.rank)
                _exit_now_if_stopped(128 + e.signum)
                return 128 + e.signum
            except BaseException as e:
                record_bug(e)
                raise
            finally:
                destroy_distributed()
        return 0
    finally:  # the process may go on (a test calling the entry point): leave no watcher behind
        for unwatch in watchers:
            if unwatch is not None:
                unwatch()


def _absolute_output_dir(cfg) -> None:
    """trainer.output_dir as an absolute path from the start: code that changes the working directory later (a
    tool or reward function calling os.chdir) cannot split the run's files across two directories."""
    trainer = getattr(cfg, "trainer", None)
    if trainer is not None and isinstance(getattr(trainer, "output_dir", None), str) and trainer.output_dir:
        trainer.output_dir = os.path.abspath(trainer.output_dir)


def _exit_now_if_stopped(code: int, stopped: bool = False) -> None:
    """Stopped by a signal (Ctrl-C, a kill of the launcher, torchrun stopping the job, a scheduler; `stopped`: the
    run stopped at a step boundary because some rank got one): the metrics are closed, the checkpoints consistent
    and the line printed, so skip the process-group and interpreter teardown (seconds with vLLM loaded; torchrun
    SIGKILLs after 30 s) and leave (spmdrl.process.launcher.exit_now)."""
    from spmdrl.faults import stop_requested
    from spmdrl.process.launcher import exit_now

    if stopped or stop_requested():
        exit_now(code)


def _stopped(e, when: str) -> str:
    return f"stopped by {e} {when}; nothing was trained yet, relaunch the same command to start"


def train_preflight(cfg, rank: int, world_size: int | None = None):
    """spmdrl.preflight on a rank: False when the resumed checkpoint is already at trainer.total_steps."""
    from spmdrl.config import to_toml
    from spmdrl.preflight import clear_previous_run, preflight

    plan = preflight(cfg, to_toml(cfg), world_size=world_size, user_code=rank == 0)
    if rank == 0 and plan.steps_line:
        logging.getLogger("spmdrl").info("%s", plan.steps_line)
    if plan.resume and plan.resume_step >= cfg.trainer.total_steps:
        if rank == 0:
            print(f"{plan.resume} is at step {plan.resume_step} and trainer.total_steps = {cfg.trainer.total_steps}: "
                  "nothing to train (raise trainer.total_steps to go on)", file=sys.stderr, flush=True)
        return False
    if rank == 0:
        clear_previous_run(plan)
    return plan


def main(argv=None) -> int:
    from spmdrl.config import Config, validate

    def run(cfg, layout, env, device):
        from spmdrl.config import to_toml
        from spmdrl.hub import localise_models
        from spmdrl.loop.trainer import Trainer
        from spmdrl.preflight import check_teacher

        # hub ids -> node-local snapshot directories (one download per node); the run records the config as given
        local = localise_models(cfg)
        check_teacher(local)  # a hub-id teacher's tokenizer family, now that its files are here
        Trainer(local, layout, env.rank, env.world_size, device, config_toml=to_toml(cfg)).fit()

    return run_entry(argv, prog="spmdrl.train", description=__doc__.split("\n\n")[0], root_cls=Config,
                     validate_fn=validate, run_fn=run, preflight_fn=train_preflight)


if __name__ == "__main__":
    from spmdrl.process.launcher import run_as_process

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_as_process(main)
