"""The environment of one run among several in one launch (train_runs.py, grpo_step.py --runs)."""
import contextlib
import os


@contextlib.contextmanager
def run_env(env: dict[str, str]):
    """Set `env` for the block, then put every variable it named back as it was (unset if it was)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
