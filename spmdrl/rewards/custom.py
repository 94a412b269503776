"""User reward functions ("path/to/file.py:fn" or "package.module:fn") and batch scoring.

A reward function has verl's signature and is called with keywords:
    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | {"score": float, ...}
With multi-turn rollouts a function that declares a `trajectory` parameter also gets the sample's turns
(docs/tools.md, "Rewards").
"""
from __future__ import annotations

import logging
import inspect
import math
import numbers
import signal
import threading
from typing import Callable

import torch

from spmdrl.errors import RewardError
from spmdrl.rewards.loader import _one_line, load_reward_fn, reward_fn_name
from spmdrl.rewards.worker import RewardTimeout

log = logging.getLogger("spmdrl")


def _as_score(value, name: str, i: int) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name} returned {type(value).__name__} for sample {i}; "
            "return a float or a dict with a float 'score'"
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward function {name} returned {value} for sample {i}; scores must be finite")
    if not _fits_float32(value):  # 1e40 is a finite Python float but inf in the float32 scores tensor
        raise RewardError(f"reward function {name} returned {value} for sample {i}, which overflows float32 "
                          f"(|score| <= {_F32_MAX:.3g}); scores must be finite after conversion")
    return value


_F32_MAX = float(torch.finfo(torch.float32).max)


def _fits_float32(value: float) -> bool:
    return math.isfinite(float(torch.tensor(value, dtype=torch.float32)))


def compute_rewards(
    fn: Callable,
    data_sources: list[str],
    solution_strs: list[str],
    ground_truths: list[str],
    extra_infos: list[dict] | None = None,
    trajectories: list[dict] | None = None,
) -> tuple[torch.Tensor, dict[str, list]]:
    """Score a batch: (scores float32 [B], extras {key: list of B values, None where a sample lacked it}).
    trajectories: multi-turn rollouts' turns per sample, passed as `trajectory=` (only to functions that take it:
    `takes_trajectory`)."""
    n = len(solution_strs)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            f"compute_rewards got {len(data_sources)} data sources, {n} solutions, {len(ground_truths)} ground "
            f"truths and {len(extra_infos)} extra infos; they must match"
        )
    name = reward_fn_name(fn)
    scores, rows = [], []
    for i in range(n):
        try:
            out = fn(
                data_source=data_sources[i],
                solution_str=solution_strs[i],
                ground_truth=ground_truths[i],
                extra_info=extra_infos[i],
                **({} if trajectories is None else {"trajectory": trajectories[i]}),
            )
        except Exception as e:
            raise RewardError(
                f"reward function {name} raised on sample {i} (data_source {data_sources[i]!r}): "
                f"{type(e).__name__}: {_one_line(e)}"
            ) from e
        if isinstance(out, dict):
            if "score" not in out:
                raise RewardError(
                    f"reward function {name} returned a dict without 'score' for sample {i} "
                    f"(keys: {', '.join(map(str, out))}); add a 'score' entry"
                )
            scores.append(_as_score(out["score"], name, i))
            rows.append({k: v for k, v in out.items() if k != "score"})
        else:
            scores.append(_as_score(out, name, i))
            rows.append({})
    keys = list(dict.fromkeys(k for row in rows for k in row))
    extras = {k: [row.get(k) for row in rows] for k in keys}
    return torch.tensor(scores, dtype=torch.float32), extras


EXTRA_SUM, EXTRA_COUNT = "_reward_extra_sum/", "_reward_extra_n/"


def extra_sums(extras: dict[str, list]) -> dict[str, float]:
    """The numeric extra keys a reward function returned (compute_rewards' extras): per key, the sum over the
    samples that returned a number (bools count 0/1; None, strings and other values are skipped) and their count."""
    out: dict[str, float] = {}
    for key, values in extras.items():
        nums = [float(v) for v in values if isinstance(v, numbers.Real) and math.isfinite(float(v))]
        if nums:
            out[EXTRA_SUM + str(key)] = sum(nums)
            out[EXTRA_COUNT + str(key)] = float(len(nums))
    return out


def extra_means(metrics: dict[str, float]) -> dict[str, float]:
    """Replace the sums and counts of extra_sums (averaged or summed alike over ranks) by reward/extra/<key>: the
    mean over every sample of the step that returned the key."""
    out = {k: v for k, v in metrics.items() if not k.startswith((EXTRA_SUM, EXTRA_COUNT))}
    for k, v in metrics.items():
        if k.startswith(EXTRA_SUM):
            key = k[len(EXTRA_SUM):]
            n = metrics.get(EXTRA_COUNT + key, 0.0)
            if n:
                out[f"reward/extra/{key}"] = v / n
    return out


def takes_trajectory(fn: Callable) -> bool:
    """Whether a reward function (or the one a GuardedReward guards) declares a `trajectory` parameter; a
    wrapper that calls it elsewhere (a RewardWorker) says so in its `takes_trajectory` attribute."""
    fn = getattr(fn, "fn", fn) if isinstance(fn, GuardedReward) else fn
    if isinstance(getattr(fn, "takes_trajectory", None), bool):
        return fn.takes_trajectory
    try:
        return "trajectory" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---- time limits and on_error ------------------------------------------------------------------------------

class _Alarm(BaseException):
    """Raised inside the reward function by SIGALRM; a BaseException so its own `except Exception` cannot
    swallow the timeout."""


def call_with_timeout(fn: Callable, timeout_s: float, **kwargs):
    """fn(**kwargs), raising RewardTimeout after `timeout_s` seconds (0 = no limit).

    In the main thread a SIGALRM interval timer interrupts the function between Python bytecodes: nothing
    keeps running afterwards and no process is spawned, but a C call that never returns to the interpreter
    (a pathological regex, a C extension loop) is only interrupted when it does. Elsewhere (signals reach only
    the main thread) the call runs in a daemon thread that is abandoned, not stopped, on timeout.
    """
    if timeout_s <= 0:
        return fn(**kwargs)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return _call_in_thread(fn, timeout_s, kwargs)

    def on_alarm(signum, frame):
        raise _Alarm()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Alarm:
        raise RewardTimeout(f"took longer than reward.timeout_s={timeout_s:g}s") from None
    finally:
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(fn: Callable, timeout_s: float, kwargs: dict):
    box: dict = {}

    def run():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="spmdrl-reward")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardTimeout(f"took longer than reward.timeout_s={timeout_s:g}s (left running in a background thread)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def build_reward_fn(reward_cfg) -> Callable:
    """The reward function a run scores with, from its [reward] section: reward.custom_fn (a user function), or
    reward.custom_fns weighted by reward.weights (WeightedRewards), each in a worker process under
    reward.timeout_s (rewards/worker.py: a timeout stops it whatever it is doing), or in this process with
    reward.in_process = true (SIGALRM: Python code only); without either, the rule functions registered by
    data_source, in this process. Wrapped in GuardedReward when reward.on_error or timeout_s ask for it."""
    r = reward_cfg
    if r.custom_fns:
        weights = r.weights or [1.0] * len(r.custom_fns)
        return WeightedRewards([_user_reward_fn(spec, r) for spec in r.custom_fns], weights, on_error=r.on_error)
    if not r.custom_fn:
        fn: Callable = default_compute_score_fn()
        if r.on_error != "raise" or r.timeout_s > 0:
            return GuardedReward(fn, on_error=r.on_error, timeout_s=r.timeout_s)
        return fn
    return _user_reward_fn(r.custom_fn, r)


def _user_reward_fn(spec: str, r) -> Callable:
    """One user function from its spec, in a worker process (or in this process) under reward.timeout_s and
    reward.on_error."""
    fn = load_reward_fn(spec)  # here too: a bad spec or module is one line before anything starts
    if r.timeout_s > 0 and not r.in_process:
        from spmdrl.rewards.worker import RewardWorker

        worker = RewardWorker(spec, r.timeout_s)
        worker.takes_trajectory = takes_trajectory(fn)  # the worker's function, as loaded here
        return GuardedReward(worker, on_error=r.on_error, timeout_s=0.0, name=spec)
    if r.on_error != "raise" or r.timeout_s > 0:
        return GuardedReward(fn, on_error=r.on_error, timeout_s=r.timeout_s)
    return fn


class WeightedRewards:
    """Several reward functions as one (TRL's reward_funcs with reward_weights):

        score = sum_i w_i * score_i

    returned as {"score": score, <name_i>: score_i, "<name_i>/<key>": each extra key function i returned}, so
    each function's mean is logged as reward/extra/<name_i> (name_i: the spec's function name, numbered when two
    share one). A multi-turn `trajectory` goes only to the functions that declare it."""

    def __init__(self, fns: list[Callable], weights: list[float], on_error: str = "raise"):
        self.fns, self.weights, self.on_error = fns, [float(w) for w in weights], on_error
        names = [reward_fn_name(f).rpartition(":")[2] or f"fn{i}" for i, f in enumerate(fns)]
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.takes = [takes_trajectory(f) for f in fns]
        self.takes_trajectory = any(self.takes)
        self.__spmdrl_spec__ = " + ".join(f"{w:g} * {reward_fn_name(f)}" for w, f in zip(self.weights, fns))

    def __call__(self, trajectory=None, **kwargs):
        out: dict = {"score": 0.0}
        for fn, w, name, takes in zip(self.fns, self.weights, self.names, self.takes):
            value = fn(**kwargs, **({"trajectory": trajectory} if takes and trajectory is not None else {}))
            extras = {}
            if isinstance(value, dict):
                if "score" not in value:
                    raise RewardError(f"reward function {reward_fn_name(fn)} returned a dict without 'score' (keys: "
                                      f"{', '.join(map(str, value))}); add a 'score' entry")
                extras = {f"{name}/{k}": v for k, v in value.items() if k != "score"}
                value = value["score"]
            score = _as_score(value, reward_fn_name(fn), 0)
            out["score"] += w * score
            out[name] = score
            out.update(extras)
        return out

    def take_counts(self) -> tuple[int, int]:
        """(errors, timeouts) of every guarded function since the last call (reward.on_error = zero)."""
        counts = [f.take_counts() for f in self.fns if isinstance(f, GuardedReward)]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)


def default_compute_score_fn() -> Callable:
    from spmdrl.rewards.registry import default_compute_score

    return default_compute_score


def _usable(out) -> bool:
    v = out.get("score") if isinstance(out, dict) else out
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    return isinstance(v, numbers.Real) and math.isfinite(float(v)) and _fits_float32(float(v))


class GuardedReward:
    """A reward function under reward.timeout_s and reward.on_error, per sample.

    on_error="raise": exceptions and timeouts propagate (compute_rewards names the sample);
    "zero": the sample scores 0 and is counted in `errors` (and `timeouts`), read with `take_counts()`.
    """

    def __init__(self, fn: Callable, *, on_error: str = "raise", timeout_s: float = 0.0, name: str | None = None):
        if on_error not in ("raise", "zero"):
            raise RewardError(f"reward.on_error = {on_error!r} is not one of raise, zero")
        self.fn, self.on_error, self.timeout_s = fn, on_error, float(timeout_s)
        self.errors = self.timeouts = 0
        self._warned = False
        self.__spmdrl_spec__ = name or reward_fn_name(fn)

    def __call__(self, **kwargs):
        try:
            out = call_with_timeout(self.fn, self.timeout_s, **kwargs)
        except RewardError:  # the function cannot be used at all (its worker could not load it)
            raise
        except Exception as e:
            if self.on_error == "raise":
                raise
            self._count(e)
            return 0.0
        if self.on_error == "zero" and not _usable(out):
            self._count(RewardError(f"returned {out!r}, not a finite score"))
            return 0.0
        return out

    def _count(self, e: Exception) -> None:
        if not self._warned:
            self._warned = True
            log.warning("reward function %s failed (%s: %s); scoring 0 and counting (reward.on_error=zero)",
                        self.__spmdrl_spec__, type(e).__name__, _one_line(e))
        self.errors += 1
        self.timeouts += isinstance(e, RewardTimeout)

    def take_counts(self) -> tuple[int, int]:
        """(errors, timeouts) since the last call."""
        out = (self.errors, self.timeouts)
        self.errors = self.timeouts = 0
        return out
