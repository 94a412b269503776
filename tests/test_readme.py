"""Every command block of README.md, in order, on a clean directory (a copy of configs/ and launch/), on CPU:
each command exits 0 and changes no file an earlier command wrote. Blocks after a `<!-- not run by
tests/test_readme.py: why -->` line are skipped (GPU, the test command itself, hours of CPU). The environment is
the installed one (the install steps are dropped) and long runs are shortened by the overrides in SHORTEN."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = "<!-- not run by tests/test_readme.py"
INSTALL = "python3 -m venv .venv && . .venv/bin/activate && bash launch/install_cpu.sh && "
GRPO_SHORT = ("trainer.total_steps=1 trainer.val_before_train=false data.train_batch_size=8 rollout.n=4 "
              "actor.ppo_mini_batch_size=8 actor.micro_batch_size=16")
# (pattern a command starts with, what replaces it or is added after it)
SHORTEN = [
    (r"pip install ", lambda c: 'python -c "import wandb, mlflow"'),  # the test extra installs both
    (r"((GRPO_CONFIG|TASK)=\S+ )?bash launch/quickstart\.sh",
     lambda c: "SFT_OVERRIDES='sft.max_steps=4 sft.batch_size=16 sft.micro_batch_size=8' " + c + " " + GRPO_SHORT),
    (r"python -m spmdrl\.train ", lambda c: c + " " + GRPO_SHORT),
    (r"spmdrl sft ", lambda c: c + " sft.max_steps=4 sft.batch_size=16 sft.micro_batch_size=8"),
    (r"spmdrl bench($| --tools )", lambda c: c + " --steps 3"),
]


def readme_blocks(text: str) -> list[tuple[bool, list[str]]]:
    """(run it?, its commands) for each ```bash block: comments and blank lines dropped, continuations joined."""
    blocks, skip, lines, inside = [], False, [], False
    for line in text.splitlines():
        if not inside and line.startswith(SKIP):
            skip = True
        elif not inside and line.strip() == "```bash":
            inside, lines = True, []
        elif inside and line.strip() == "```":
            joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
            cmds = [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]
            blocks.append((not skip, cmds))
            inside, skip = False, False
        elif inside:
            lines.append(line)
    return blocks


def shorten(cmd: str) -> str:
    cmd = cmd.replace(INSTALL, "")
    for pattern, fix in SHORTEN:
        if re.match(pattern, cmd):
            return fix(cmd)
    return cmd


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                st = os.stat(p)
                out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_readme_blocks_parse():
    blocks = readme_blocks(open(os.path.join(REPO, "README.md")).read())
    run = [c for ok, cmds in blocks if ok for c in cmds]
    assert run[0].startswith(INSTALL) and "bash launch/quickstart.sh" in run[0]
    assert not any("torchrun" in c or "--nproc-per-node 8" in c for c in run)  # GPU blocks are marked
    assert any(c.startswith("spmdrl export") for c in run)
    outs = [m.group(1) for c in run for m in re.finditer(r"trainer\.output_dir=(\S+)", c)]
    assert len(outs) == len(set(outs)), outs  # every run its own directory


@pytest.mark.dist
def test_every_readme_command_in_order_on_a_clean_directory(tmp_path):
    pytest.importorskip("vllm")
    root = tmp_path / "clone"
    for d in ("configs", "launch", "slurm"):
        shutil.copytree(os.path.join(REPO, d), root / d)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    blocks = readme_blocks(open(os.path.join(REPO, "README.md")).read())
    for ok, cmds in blocks:
        for cmd in cmds if ok else []:
            before = snapshot(str(root))
            full = shorten(cmd)
            proc = subprocess.run(["bash", "-c", full], cwd=root, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"{full}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            after = snapshot(str(root))
            touched = sorted(p for p, st in before.items() if after.get(p) != st)
            assert not touched, f"{cmd} changed or removed earlier outputs: {touched[:10]}"
