"""Experiment trackers: Weights & Biases and MLflow, selected by `logging.backends`.

Each is an optional extra, imported only when selected (`pip install 'spmdrl[wandb]'`, `'spmdrl[mlflow]'`);
check_backends() says in one line, before launch, when a selected one is not installed or not configured.

Rank 0 logs. A run gets a name, a group and tags from the config (a sweep sets them per point), the resolved
config as its parameters, and each step's metrics under the same names and step as metrics.jsonl. The
tracker's run id is kept in output_dir/trackers.json, so a resumed run continues the same tracker run.

A tracker never stops or stalls training: its calls run on a thread of their own (Background), a call that
raises is a warning and a count (MetricsLogger logs it as `logging/<backend>_failures`), a tracker that does
not keep up loses records (counted the same way) instead of blocking the step, and the end of the run waits
at most logging.tracker_timeout_s for it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from spmdrl.errors import ConfigError

log = logging.getLogger("spmdrl")

BACKENDS = ("tensorboard", "jsonl", "wandb", "mlflow")
TRACKERS = ("wandb", "mlflow")  # remote-capable, optional, run in the background
IDS_FILE = "trackers.json"


# --------------------------------------------------------------------------------------------- selection


def selected_backends(lg) -> list[str]:
    """logging.backends, less tensorboard/jsonl when their shorthand booleans are false."""
    off = {name for name, on in (("tensorboard", lg.tensorboard), ("jsonl", lg.jsonl)) if not on}
    return [b for b in dict.fromkeys(lg.backends) if b not in off]


def wandb_mode(lg) -> str:
    return lg.wandb_mode or os.environ.get("WANDB_MODE", "") or "online"


def mlflow_uri(lg) -> str:
    """logging.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else the file store ./mlruns (an absolute file: URI)."""
    uri = lg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "") or "mlruns"
    if "://" not in uri and not uri.startswith("file:"):
        uri = "file:" + os.path.abspath(os.path.expanduser(uri))
    return uri


def _wandb_has_key() -> bool:
    """An API key is set (WANDB_API_KEY) or stored by `wandb login` (~/.netrc, or $NETRC); no network."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return bool(os.path.isfile(path) and netrc.netrc(path).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def check_backends(lg) -> None:
    """One-line ConfigError for an unknown, uninstalled or unconfigured backend (no import, no network)."""
    for b in lg.backends:
        if b not in BACKENDS:
            raise ConfigError(f"logging.backends: {b!r} is not one of {', '.join(BACKENDS)}")
    chosen = selected_backends(lg)
    for b in TRACKERS:
        if b in chosen and importlib.util.find_spec(b) is None:
            raise ConfigError(f"logging.backends includes {b} but {b} is not installed; "
                              f"pip install 'spmdrl[{b}]' (or take {b} out of logging.backends)")
    if "wandb" in chosen:
        mode = wandb_mode(lg)
        if mode not in ("online", "offline", "disabled"):
            raise ConfigError(f"logging.wandb_mode = {mode!r} (or WANDB_MODE) is not one of online, offline, disabled")
        if mode == "online" and not _wandb_has_key():
            raise ConfigError("logging.backends includes wandb in online mode but no API key is set; set WANDB_API_KEY, "
                              "run `wandb login`, or set logging.wandb_mode = \"offline\" (no account needed)")
    if lg.tracker_timeout_s < 0:
        raise ConfigError(f"logging.tracker_timeout_s must be >= 0, found {lg.tracker_timeout_s}")


# --------------------------------------------------------------------------------------------- the run


@dataclass
class TrackerRun:
    """What a tracker is told about the run."""

    output_dir: str
    name: str
    project: str
    group: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, nested
    resume: bool = False  # continue the run recorded in output_dir/trackers.json
    config_file: str = ""  # output_dir/config.toml, attached to the MLflow run

    @property
    def params(self) -> dict[str, str]:
        """The config as flat `section.key` -> string parameters."""
        out = {}
        for sec, values in self.config.items():
            for k, v in values.items() if isinstance(values, dict) else [("", values)]:
                out[f"{sec}.{k}" if k else sec] = v if isinstance(v, str) else json.dumps(v)
        return out


def tracker_run(cfg, *, resume: bool) -> TrackerRun:
    """The TrackerRun of a Config or SFTConfig: name from logging.run_name, trainer.experiment_name or the
    output_dir's name; project, group and tags from [logging]."""
    lg, out = cfg.logging, cfg.trainer.output_dir
    name = lg.run_name or cfg.trainer.experiment_name or os.path.basename(os.path.normpath(out))
    path = os.path.join(out, "config.toml")
    return TrackerRun(out, name, lg.project, lg.group, list(lg.tags), dataclasses.asdict(cfg), resume,
                      path if os.path.isfile(path) else "")


_ids_lock = threading.Lock()


def read_ids(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, IDS_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_id(output_dir: str, backend: str, record: dict) -> None:
    with _ids_lock:
        ids = read_ids(output_dir)
        ids[backend] = record
        tmp = os.path.join(output_dir, IDS_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(ids, f, indent=1)
        os.replace(tmp, os.path.join(output_dir, IDS_FILE))


# --------------------------------------------------------------------------------------------- the sinks


class WandbSink:
    """One wandb run per spmdrl run, its files under output_dir/wandb. Metrics are plotted against `step` (the
    spmdrl step, a metric of its own), so a resumed run that re-logs the steps after its checkpoint keeps them."""

    def __init__(self, run: TrackerRun, lg):
        self.info, self.lg, self.run = run, lg, None

    def open(self) -> None:
        if (os.environ.get("SPMDRL_VERBOSITY") or self.lg.verbosity) != "debug":
            os.environ.setdefault("WANDB_SILENT", "true")  # no banners or links on the console (the run dir has them)
        import wandb

        info = self.info
        prev = read_ids(info.output_dir).get("wandb", {}) if info.resume else {}
        run_id = prev.get("id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=info.project, entity=self.lg.wandb_entity or None, group=info.group or None, name=info.name,
            tags=[t[:64] for t in info.tags] or None, dir=info.output_dir, id=run_id, resume="allow",
            mode=wandb_mode(self.lg), settings=wandb.Settings(console="off", silent=True),
        )
        self.run.config.update(info.config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        _write_id(info.output_dir, "wandb", {"id": self.run.id, "project": info.project})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        import wandb

        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = [[v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v)
                 for v in (r.get(c) for c in columns)] for r in rows]
        self.run.log({name: wandb.Table(columns=columns, data=data), "step": step})

    def close(self, failed: bool) -> None:
        import wandb

        code = 1 if failed else 0
        try:
            if self.run is not None:
                self.run.finish(exit_code=code)
        finally:
            # wandb's service, torn down here rather than by wandb's atexit hook (which this unregisters first):
            # a service that died (killed, out of memory) is then this sink's one warning, not a traceback at exit
            try:
                wandb.teardown(exit_code=code)
            except BaseException as e:  # SystemExit with the service's exit code, too
                raise RuntimeError(f"wandb's service did not shut down cleanly ({type(e).__name__}: "
                                   f"{' '.join(str(e).split())[:200]})") from None


def _mlflow_key(name: str) -> str:
    """MLflow takes letters, digits, _ - . space and /: anything else becomes _."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in name)


class MlflowSink:
    """One MLflow run per spmdrl run in the experiment `project` (or `project/group`): the config as
    parameters, config.toml as an artifact, each step's metrics at that step."""

    MAX_PARAM = 6000  # MLflow's longest parameter value

    def __init__(self, run: TrackerRun, lg):
        self.info, self.lg, self.client, self.run_id = run, lg, None, None

    def open(self) -> None:
        uri = mlflow_uri(self.lg)
        if uri.startswith("file:"):  # MLflow 3 asks file stores to opt in; spmdrl's default store is one
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        info = self.info
        client = self.client = MlflowClient(tracking_uri=uri)
        experiment = f"{info.project}/{info.group}" if info.group else info.project
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                exp_id = client.create_experiment(experiment)
            except Exception:  # a sweep's other run created it meanwhile
                exp_id = client.get_experiment_by_name(experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        prev = read_ids(info.output_dir).get("mlflow", {}) if info.resume else {}
        params = {k: v[: self.MAX_PARAM] for k, v in info.params.items()}
        if prev.get("run_id") and prev.get("tracking_uri") == uri:
            self.run_id = prev["run_id"]
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            old = client.get_run(self.run_id).data.params
            changed = sorted(k for k in params if k in old and old[k] != params[k])
            if changed:  # MLflow parameters cannot change; the resumed run's config.toml has the new values
                log.warning("mlflow: the resumed run keeps its first values of %s", ", ".join(changed))
            params = {k: v for k, v in params.items() if k not in old}
        else:
            tags = {"spmdrl.group": info.group} if info.group else {}
            for t in info.tags:
                k, _, v = t.partition("=")
                tags[_mlflow_key(k)] = v
            self.run_id = client.create_run(exp_id, run_name=info.name, tags=tags).info.run_id
            if info.config_file:
                client.log_artifact(self.run_id, info.config_file)
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's most parameters per batch
            client.log_batch(self.run_id, params=items[i: i + 100])
        _write_id(info.output_dir, "mlflow", {"run_id": self.run_id, "experiment": experiment, "tracking_uri": uri})

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        items = [Metric(_mlflow_key(k), v, ms, int(step)) for k, v in values.items()]
        for i in range(0, len(items), 1000):  # MLflow's most metrics per batch
            self.client.log_batch(self.run_id, metrics=items[i: i + 1000])

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        self.client.log_text(self.run_id, text, f"{name}/step_{step:08d}.jsonl")

    def close(self, failed: bool) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


SINKS: dict[str, Callable[[TrackerRun, Any], Any]] = {"wandb": WandbSink, "mlflow": MlflowSink}


class Background:
    """Runs one sink's open, log and close calls in order on a daemon thread, so the training loop never waits
    on a tracker. A call that raises is counted and warned about (the first, then every 100th); after a failed
    open every record is counted as lost. Records beyond `max_pending` waiting are dropped and counted."""

    def __init__(self, name: str, sink, timeout_s: float, max_pending: int = 1000):
        self.name, self.sink, self.timeout_s = name, sink, timeout_s
        self.failures = 0
        self._opened = False
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._work, name=f"spmdrl-{name}", daemon=True)
        self._thread.start()
        self._put(("open",))

    def _fail(self, what: str, e: BaseException | None) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}" if e is not None else "it is not keeping up"
            log.warning("%s: %s failed (%s); training goes on (failure %d, logged as logging/%s_failures)",
                        self.name, what, why, self.failures, self.name)

    def _put(self, item) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self._fail(f"step {item[1]}" if item[0] == "log" else item[0], None)

    def _work(self) -> None:
        while True:
            item = self._q.get()
            kind = item[0]
            if kind == "open":
                try:
                    self.sink.open()
                    self._opened = True
                except Exception as e:
                    self._fail("starting the run", e)
            elif kind in ("log", "table"):
                if not self._opened:
                    self.failures += 1  # warned about when open failed
                    continue
                try:
                    self.sink.log(item[1], item[2]) if kind == "log" else self.sink.log_table(*item[1:])
                except Exception as e:
                    self._fail(f"logging step {item[1]}", e)
            else:  # close
                try:
                    if self._opened:
                        self.sink.close(item[1])
                except Exception as e:
                    self._fail("finishing the run", e)
                return

    def log(self, step: int, values: dict[str, float]) -> None:
        self._put(("log", step, dict(values)))

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        self._put(("table", step, name, [dict(r) for r in rows]))

    def close(self, failed: bool) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:  # the close record must get in, even behind a full queue
            try:
                self._q.put(("close", failed), timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            what = "finishing the run" if self._opened else "still starting the run (is its service reachable?)"
            log.warning("%s: %s after logging.tracker_timeout_s = %g s; the run ends without waiting for it",
                        self.name, what, self.timeout_s)


def open_tracker(name: str, run: TrackerRun, lg) -> Background:
    return Background(name, SINKS[name](run, lg), lg.tracker_timeout_s)


__all__ = ["BACKENDS", "Background", "IDS_FILE", "TrackerRun", "check_backends", "mlflow_uri", "open_tracker",
           "read_ids", "selected_backends", "tracker_run", "wandb_mode"]
