"""The model-coverage sweep: every decoder architecture that both transformers and vLLM register, as a tiny
random instance, through spmdrl's GRPO loop; the verdict per architecture, and docs/models.md's table.

    spmdrl model sweep --out outputs/sweep [--arch qwen2 --arch cohere ...] [--docs docs/models.md]

1. `architectures()` enumerates them: transformers' causal-LM mapping (model type -> class name) against vLLM's
   model registry (the architectures it implements). Nothing is listed by hand.
2. The parent process builds each one tiny (spmdrl.tiny.build_any: the published defaults scaled down); a model
   type that cannot be built that way is "unbuildable", with transformers' reason.
3. One shared job (2 ranks, gloo, `python -m spmdrl.model_sweep`) runs every buildable architecture in turn
   through the Trainer: config validation, the FSDP2 actor at dp 2, vLLM at rollout TP 2, the parity check
   before step 1 (loop/parity.py), 2 GRPO steps (the weight sync after step 1, then step 2 samples with the
   synced weights). Each rank appends one JSON line per architecture; a job that dies (a crash in native code)
   is started again for the architectures after the one it died in, which is recorded as crashed.
4. Verdicts: "trains" (rc 0, vLLM-vs-actor gap at step 2 below 1e-5 in float32 and the sync's bytes per rank at
   the lower bound of its routes), "refused" (an SpmdrlError: one line, before step 1), "stopped" (the mismatch
   guard stopped it during training), "mismatch" (rc 0, but a gap or the bytes are off: the guards missed it),
   "crashed" (any other exception), "unbuildable".
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

from spmdrl.errors import summary

TRAIN_GAP = 1e-5  # float32: vLLM's log-probs against the actor's at step 2
VERDICTS = ("trains", "refused", "stopped", "mismatch", "crashed", "unbuildable")


def architectures() -> dict[str, str]:
    """model type -> causal-LM class name, for every model type whose class vLLM's registry implements."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import ModelRegistry

    served = set(ModelRegistry.get_supported_archs())
    return {mt: cls for mt, cls in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()) if cls in served}


def one_line(e: BaseException) -> str:
    return summary(e, width=280, lines=3)


def build_models(archs: list[str], root: str) -> dict[str, dict]:
    """Build each tiny model under root/models/<arch>; {arch: result} for the ones that could not be built."""
    from spmdrl.tiny import build_any

    failed = {}
    for arch in archs:
        out = os.path.join(root, "models", arch)
        if os.path.isfile(os.path.join(out, "config.json")):
            continue
        try:
            build_any(out, arch)
        except Exception as e:  # whatever transformers raises for the scaled config
            failed[arch] = {"arch": arch, "verdict": "unbuildable", "why": one_line(e)}
    return failed


def split_case(case: str) -> tuple[str, list[str]]:
    """"arch" or "arch@key=value,key=value" (the same architecture with overrides) -> (arch, overrides)."""
    arch, _, extra = case.partition("@")
    return arch, [kv for kv in extra.split(",") if kv]


def run_dir(root: str, case: str) -> str:
    return os.path.join(root, "runs", case.replace("@", "+").replace("=", "-").replace(",", "+").replace("/", "_"))


def train_overrides(root: str, case: str, data: str) -> list[str]:
    """The GRPO run of one case (the quickstart's config at tiny sizes, as launch/model_families.sh)."""
    arch, extra = split_case(case)
    return [
        f"model.path={root}/models/{arch}", f"data.train_files=[\"{data}/train.parquet\"]", "data.val_files=[]",
        "data.max_prompt_length=32", "data.max_response_length=8", "data.train_batch_size=4", "rollout.n=4",
        "rollout.kv_cache_gb=0.1", "actor.lr=1e-3", "actor.micro_batch_size=4", "actor.ppo_mini_batch_size=2",
        "trainer.total_steps=2", "trainer.device=cpu", f"trainer.output_dir={run_dir(root, case)}",
        "trainer.overwrite=true", "logging.progress=false", "placement.rollout_tp=2", "trainer.dist_timeout_s=120",
        "checkpoint.save_every_min=0", *extra,
    ]


def verdict(metrics: dict) -> tuple[str, str]:
    gap = metrics.get("rollout/logprob_diff_max", float("nan"))
    recv, bound = metrics.get("weight_sync/bytes_recv_max"), metrics.get("weight_sync/bytes_lower_bound")
    if not gap <= TRAIN_GAP:
        return "mismatch", f"gap at step 2 {gap:.3g} > {TRAIN_GAP:g}"
    if recv is not None and bound is not None and recv > bound:
        return "mismatch", f"sync received {int(recv)} bytes per rank > lower bound {int(bound)}"
    return "trains", ""


# ---- rank side: one shared job ------------------------------------------------------------------------------

def run_rank(cases: list[str], root: str, data: str, config: str) -> None:
    """Every rank: each case (an architecture, split_case) in turn through the Trainer; one JSON line per case in
    root/results.rank<r>.jsonl, written before the next starts."""
    import torch

    from spmdrl.config import Config, validate
    from spmdrl.config.loader import load_config
    from spmdrl.dist.init import init_distributed
    from spmdrl.errors import SpmdrlError
    from spmdrl.loop.trainer import Trainer
    from spmdrl.train import apply_verbosity, setup_logging

    env, device = init_distributed("cpu", 120.0)
    setup_logging(env.rank)
    apply_verbosity("info")
    out = open(os.path.join(root, f"results.rank{env.rank}.jsonl"), "a")
    for case in cases:
        t0, trainer = time.perf_counter(), None
        row = {"arch": case}
        try:
            cfg = load_config(config, train_overrides(root, case, data), root_cls=Config)
            layout = validate(cfg, env.world_size, trackers=False)
            trainer = Trainer(cfg, layout, env.rank, env.world_size, device)
            metrics = trainer.fit()
            row["verdict"], row["why"] = verdict(metrics)
            row.update({k: metrics.get(k) for k in ("rollout/logprob_diff_max", "weight_sync/bytes_recv_max",
                                                    "weight_sync/bytes_lower_bound")})
            row["compute"] = list(trainer.actor.compute)
        except SpmdrlError as e:  # before step 1: refused; during training: the mismatch guard stopped it
            stopped = trainer is not None and trainer.global_step > 0
            row.update(verdict="stopped" if stopped else "refused", why=" ".join(str(e).split()))
        except Exception as e:  # noqa: BLE001 - a crash is a verdict, the sweep goes on
            traceback.print_exc()
            row.update(verdict="crashed", why=one_line(e))
        finally:
            if trainer is not None and trainer.rollout is not None:
                trainer.rollout.close()
            del trainer
            gc.collect()
        row["seconds"] = round(time.perf_counter() - t0, 1)
        out.write(json.dumps(row) + "\n")
        out.flush()
    out.close()
    torch.distributed.barrier()


# ---- parent side --------------------------------------------------------------------------------------------

def _done(root: str) -> dict[str, dict]:
    path = os.path.join(root, "results.rank0.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
    return {r["arch"]: r for r in rows}


def sweep(root: str, cases: list[str] | None = None, *, config: str = "configs/quickstart/grpo.toml",
          timeout_s: float = 600.0) -> list[dict]:
    """Run the sweep into root; returns one result per case (default: every architecture, architectures()
    order). A case is a model type, or "type@key=value,..." for the same type with config overrides."""
    from spmdrl.data.synthetic import make_arith
    from spmdrl.errors import ConfigError

    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    known = architectures()
    cases = list(known) if not cases else list(cases)
    unknown = [c for c in cases if split_case(c)[0] not in known]
    if unknown:
        raise ConfigError(f"--arch {', '.join(unknown)}: not a model type both transformers and vLLM register; "
                          f"`spmdrl model sweep --list` prints them")
    data = os.path.join(root, "data")
    if not os.path.isfile(os.path.join(data, "train.parquet")):
        make_arith(data, n_train=256, n_val=0, seed=0)
    unbuildable = build_models(list(dict.fromkeys(split_case(c)[0] for c in cases)), root)
    results = {c: {**unbuildable[split_case(c)[0]], "arch": c} for c in cases if split_case(c)[0] in unbuildable}
    for path in (os.path.join(root, f"results.rank{r}.jsonl") for r in range(2)):
        if os.path.isfile(path):
            os.remove(path)
    todo = [c for c in cases if c not in results]
    for case in todo:  # a fresh run each time (a previous sweep's checkpoint would be resumed)
        shutil.rmtree(run_dir(root, case), ignore_errors=True)
    while todo:
        _launch(todo, root, data, config, timeout_s * len(todo))
        done = _done(root)
        left = [c for c in todo if c not in done]
        if left:  # the job died in left[0]: a crash in native code, or a hang past the timeout
            results[left[0]] = {"arch": left[0], "verdict": "crashed", "why": _last_error(root)}
            left = left[1:]
        todo = left
    results.update(_done(root))
    return [results[c] for c in cases]


def _launch(archs: list[str], root: str, data: str, config: str, timeout_s: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "spmdrl.model_sweep", "--root", root, "--data", data, "--config", config, *archs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(os.path.join(root, "job.log"), "a") as log:
        try:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            log.write("sweep job: timed out\n")


def _last_error(root: str) -> str:
    lines = [ln.strip() for ln in open(os.path.join(root, "job.log"), errors="replace")] if os.path.isfile(
        os.path.join(root, "job.log")) else []
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Signal" in ln or "timed out" in ln:
            return ln[:300]
    return "the job ended without a result for it"


def table(results: list[dict]) -> str:
    """docs/models.md's coverage table (markdown), with the count per verdict first."""
    counts = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
    lines = [f"{len(results)} architectures: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v]) + ".",
             "", "| model type | verdict | gap at step 2 | sync bytes per rank (lower bound) | actor compute | why |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        gap = r.get("rollout/logprob_diff_max")
        recv, bound = r.get("weight_sync/bytes_recv_max"), r.get("weight_sync/bytes_lower_bound")
        sync = f"{int(recv):,} ({int(bound):,})" if recv is not None and bound is not None else ""
        comp = " + ".join(r["compute"]) if r.get("compute") else ""
        why = (r.get("why") or "").removeprefix("step 0, stage 'parity_check': ")
        why = (why[:237] + "...") if len(why) > 240 else why
        why = why.replace("|", "\\|")
        lines.append(f"| {r['arch']} | {r['verdict']} | {'' if gap is None else f'{gap:.1e}'} | {sync} | {comp} | {why} |")
    return "\n".join(lines)


BEGIN, END = "<!-- coverage table: spmdrl model sweep -->", "<!-- end of coverage table -->"


def write_docs(path: str, text: str) -> None:
    """Replace the generated block of `path` (between BEGIN and END) with `text`."""
    doc = open(path).read()
    if BEGIN not in doc or END not in doc:
        from spmdrl.errors import ConfigError

        raise ConfigError(f"{path}: no '{BEGIN}' ... '{END}' block to fill in")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="spmdrl.model_sweep", description="rank side of `spmdrl model sweep`")
    p.add_argument("--root", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("archs", nargs="+")
    a = p.parse_args(argv)
    run_rank(a.archs, a.root, a.data, a.config)
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import run_as_process

    run_as_process(main)
