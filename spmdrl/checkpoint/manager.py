"""CheckpointManager: atomic sharded save, verified load, keep-last retention."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from spmdrl.errors import CheckpointError
from spmdrl.faults import DeferredStop, Terminated, slow_save_if_injected

from .dcp import (
    dcp_error, describe_error, engine_manifest, engine_state, safe_reader, single_process_quiet, tensor_only_planner,
)
from .files import (
    FORMAT, MANIFEST, MARKER, TMP_PREFIX, fsync_dir, is_complete, jsonable, latest_checkpoint, list_checkpoints,
    read_json, rng_from_json, rng_to_json, sha256, state_dir, step_dir, write_bytes, write_json,
)
from .verify import check_compatible, check_files, check_metadata, intact, read_manifest

log = logging.getLogger("spmdrl")


class CheckpointManager:
    """Atomic sharded save, verified load and keep-last retention under one root directory.

    Every rank calls `save` and `load` (they are collective when a process group exists; without one they
    run in a single process, as `spmdrl export` and the unit tests do).
    """

    def __init__(self, root: str, *, keep_last: int = 2, device: torch.device | str = "cpu", fallback: bool = False,
                 writer: int = 0):
        self.root = root
        self.writer = writer  # the rank that writes trainer.json, the manifest and the HF files (it holds the engines)
        self.fallback = fallback  # checkpoint.resume = auto: a checksum failure falls back to an older checkpoint
        self.keep_last = keep_last
        self.device = torch.device(device)
        self.dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.dist else 0
        self.world_size = dist.get_world_size() if self.dist else 1
        # which run this is: set by the first save of a fresh run, inherited from the checkpoint on resume;
        # retention deletes only this run's checkpoints
        self.run_id: str | None = None

    # -- collectives on one small tensor; everyone learns who failed
    def _first_failure(self, failed: bool) -> int:
        return self._agree(failed, 0)[0]

    def _agree(self, failed: bool, stop: int) -> tuple[int, int]:
        """(-1 when every rank succeeded, else the lowest failing rank; the signal any rank was asked to stop
        with, else 0). Every rank calls it at the same points, so all leave a save at the same collective."""
        if not self.dist:
            return (self.rank if failed else -1), stop
        t = torch.tensor([self.world_size - self.rank if failed else 0, stop], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        v, sig = (int(x) for x in t.tolist())
        return (self.world_size - v if v else -1), sig

    def agree_stop(self, signum: int) -> int:
        """The stop signal any rank was asked to stop with, else 0 (every rank calls it at the same point: the
        training loop's step boundary)."""
        return self._agree(False, signum)[1]

    def _any(self, flags: list[bool]) -> list[bool]:
        if not self.dist:
            return flags
        t = torch.tensor([int(f) for f in flags] or [0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()][: len(flags)]

    # -- save
    def save(self, step: int, *, engines: dict[str, Any], trainer_state: dict, config_toml: str,
             rng: dict | None = None, hf_files=None, rank_tensors: dict | None = None,
             roles: list[str] | None = None) -> str:
        """Write checkpoint `step`. engines: name -> engine (those this rank holds); roles: every engine name of
        the run, the same on every rank (default: sorted(engines)); trainer_state: JSON-able (rank 0's is kept);
        rng: this rank's spmdrl.rng.rng_state(); hf_files(dir): rank 0 writes the HF config and tokenizer."""
        # SIGTERM/SIGINT wait for the next agreement point: a rank leaving mid-save would leave the others in
        # a collective it never joins (DCP's or ours)
        with DeferredStop() as stop:
            return self._save(stop, step, engines=engines, trainer_state=trainer_state, config_toml=config_toml,
                              rng=rng, hf_files=hf_files, rank_tensors=rank_tensors, roles=roles)

    def _save(self, stop: DeferredStop, step: int, *, engines: dict[str, Any], trainer_state: dict, config_toml: str,
              rng: dict | None, hf_files, rank_tensors: dict | None = None, roles: list[str] | None = None) -> str:
        t0 = time.perf_counter()
        self.run_id = self.run_id or uuid.uuid4().hex
        final, tmp = step_dir(self.root, step), os.path.join(self.root, f"{TMP_PREFIX}step_{step:08d}")
        err: BaseException | None = None
        if self.rank == self.writer:
            try:
                os.makedirs(self.root, exist_ok=True)
                for name in os.listdir(self.root):  # a crashed save's leftovers
                    if name.startswith(TMP_PREFIX):
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
                os.makedirs(os.path.join(tmp, "rng"))
            except OSError as e:
                err = e
        self._raise_if_failed(stop, err, step, tmp, "preparing")
        try:
            from torch.distributed.checkpoint import FileSystemWriter, save as dcp_save

            # one engine at a time, each in its own DCP directory: an engine that parks state in host memory
            # brings back only what a checkpoint holds, and parks it again before the next engine's turn
            meta = {}
            for name in roles if roles is not None else sorted(engines):
                engine = engines.get(name)  # None on ranks that do not hold it (split placement's rollout ranks)
                with engine.checkpoint_access() if engine is not None else contextlib.nullcontext():
                    tensors = {}
                    if engine is not None:
                        tensors[name], meta[name] = engine_state(engine)
                    with single_process_quiet():
                        dcp_save(tensors, storage_writer=FileSystemWriter(state_dir(tmp, name)), no_dist=not self.dist)
            slow_save_if_injected(self.rank, step)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            err = dcp_error(e)
        if err is None:  # DCP already agreed: its failures raise on every rank
            try:
                if rank_tensors:  # per-rank tensors (split placement's in-flight batches): safetensors, no pickle
                    from safetensors.torch import save_file

                    os.makedirs(os.path.join(tmp, "rank_tensors"), exist_ok=True)
                    save_file(rank_tensors, os.path.join(tmp, "rank_tensors", f"rank_{self.rank}.safetensors"))
                if rng is not None:
                    write_json(os.path.join(tmp, "rng", f"rank_{self.rank}.json"), rng_to_json(rng))
                if self.rank == self.writer:
                    state = {"step": step, **jsonable(trainer_state), "engines": meta}
                    write_json(os.path.join(tmp, "trainer.json"), state)
                    write_bytes(os.path.join(tmp, "config.toml"), config_toml.encode())
                    if hf_files is not None:
                        hf_files(os.path.join(tmp, "hf"))
            except Exception as e:
                err = e
        self._raise_if_failed(stop, err, step, tmp, "writing")
        try:
            self._write_hashes(tmp)
        except OSError as e:
            err = e
        self._raise_if_failed(stop, err, step, tmp, "checksumming")
        if self.rank == self.writer:
            try:
                manifest = self._manifest(step, engines, tmp)
                write_json(os.path.join(tmp, MANIFEST), manifest)
                commit(tmp, final, {"step": step, "time": time.time()})
            except OSError as e:
                err = e
        self._raise_if_failed(stop, err, step, tmp, "committing")
        if self.rank == self.writer:
            self._retain()
            log.info("checkpoint step %d saved to %s in %.1fs", step, final, time.perf_counter() - t0)
        return final

    def _raise_if_failed(self, stop: DeferredStop, err: BaseException | None, step: int, tmp: str, what: str) -> None:
        bad, signum = self._agree(err is not None, stop.signum)
        if bad < 0 and (not signum or what == "committing"):
            return  # committed: the checkpoint stands, and the pending signal is delivered after the save
        if self.rank == self.writer:
            shutil.rmtree(tmp, ignore_errors=True)
            final = step_dir(self.root, step)
            if os.path.isdir(final) and not is_complete(final):  # renamed, but the marker was not written
                shutil.rmtree(final, ignore_errors=True)
        if bad < 0:  # a stop request, agreed by every rank; the tmp directory is gone
            stop.consume()
            raise Terminated(signum)
        prev = latest_checkpoint(self.root)
        keep = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
        cause = describe_error(err) if err is not None else f"see rank {bad}'s error"
        raise CheckpointError(f"saving checkpoint step {step} under {self.root} failed while {what} on rank {bad}: "
                              f"{cause}; {keep}")

    def _files(self, d: str) -> list[str]:
        out = []
        for base, _, names in os.walk(d):
            for n in names:
                rel = os.path.relpath(os.path.join(base, n), d)
                if rel not in (MANIFEST, MARKER) and not rel.startswith(".sha-rank"):
                    out.append(rel)
        return sorted(out)

    def _write_hashes(self, tmp: str) -> None:
        files = self._files(tmp)
        mine = {rel: sha256(os.path.join(tmp, rel)) for rel in files[self.rank:: self.world_size]}
        write_json(os.path.join(tmp, f".sha-rank{self.rank}.json"), mine)

    def _manifest(self, step: int, engines: dict, tmp: str) -> dict:
        hashes = {}
        for r in range(self.world_size):
            p = os.path.join(tmp, f".sha-rank{r}.json")
            hashes.update(read_json(p, "checkpoint save"))
            os.remove(p)
        files = {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "sha256": hashes[rel]}
                 for rel in self._files(tmp)}
        return {
            "format": FORMAT, "step": step, "run_id": self.run_id, "world_size": self.world_size, "torch": torch.__version__,
            "engines": {name: engine_manifest(e) for name, e in engines.items()},
            "files": files,
        }

    def _retain(self) -> None:
        """Keep this run's newest keep_last checkpoints; another run's (a different run_id) are never touched."""
        if self.keep_last <= 0:
            return
        mine = [p for _, p in list_checkpoints(self.root) if run_id_of(p) == self.run_id]
        for path in mine[: -self.keep_last]:
            try:
                os.remove(os.path.join(path, MARKER))  # first: a half-deleted checkpoint is never complete
                shutil.rmtree(path)
            except OSError as e:
                log.warning("could not delete old checkpoint %s: %s", path, e)

    # -- load
    def load(self, path: str, *, engines: dict[str, Any], config_toml: str | None = None) -> dict:
        """Verify `path` against these engines and config, then load the engines in place. Returns the
        trainer state (JSON) with "rng" set to this rank's RNG state when the world size is unchanged."""
        manifest = read_manifest(path)
        check_files(path, manifest)
        check_metadata(path, manifest)
        check_compatible(path, manifest, engines, config_toml)
        try:
            self._verify_checksums(path, manifest)
        except CheckpointError as e:
            older = self._older_intact(path) if self.fallback else None
            if older is None:
                raise
            log.warning("checkpoint.resume = auto: %s; resuming from %s instead", e, older)
            return self.load(older, engines=engines, config_toml=config_toml)
        self.run_id = manifest.get("run_id") or self.run_id
        state = read_json(os.path.join(path, "trainer.json"), f"checkpoint {path}")
        rng_path = os.path.join(path, "rng", f"rank_{self.rank}.json")
        err = None
        if manifest["world_size"] == self.world_size and os.path.isfile(rng_path):
            try:  # per rank: agree before anyone goes on alone
                state["rng"] = rng_from_json(read_json(rng_path, f"checkpoint {path}"))
                tensors_path = os.path.join(path, "rank_tensors", f"rank_{self.rank}.safetensors")
                if os.path.isfile(tensors_path):
                    from safetensors.torch import load_file

                    state["rank_tensors"] = load_file(tensors_path)
            except CheckpointError as e:
                err = e
        bad = self._first_failure(err is not None)
        if bad >= 0:
            raise err or CheckpointError(f"checkpoint {path}: rank {bad}'s RNG state is unreadable (see its error)")
        if os.path.isfile(os.path.join(path, "state", ".metadata")):
            self._load_together(path, engines, state)  # written before engines were saved one at a time
        else:
            for name in sorted(manifest["engines"]):  # one engine's state on the device at a time, as saved
                engine = engines.get(name)
                with engine.checkpoint_access() if engine is not None else contextlib.nullcontext():
                    targets = {name: engine_state(engine)[0]} if engine is not None else {}
                    self._dcp_load(path, state_dir(path, name), targets)
                    if engine is not None:
                        engine.load_checkpoint_state(targets[name], state.get("engines", {}).get(name, {}))
        state["path"] = path
        return state

    def _load_together(self, path: str, engines: dict[str, Any], state: dict) -> None:
        """A checkpoint whose engines share one DCP directory (state/): every engine loaded at once."""
        targets = {name: engine_state(e)[0] for name, e in engines.items()}
        self._dcp_load(path, os.path.join(path, "state"), targets)
        for name, engine in engines.items():
            engine.load_checkpoint_state(targets[name], state.get("engines", {}).get(name, {}))

    def _dcp_load(self, path: str, directory: str, targets: dict) -> None:
        from torch.distributed.checkpoint import load as dcp_load

        try:
            with single_process_quiet():
                dcp_load(targets, storage_reader=safe_reader(directory), planner=tensor_only_planner(),
                         no_dist=not self.dist)
        except (Exception, CheckpointException) as e:
            inner = dcp_error(e)
            if isinstance(inner, CheckpointError):
                raise inner from None
            raise CheckpointError(f"checkpoint {path}: loading tensors failed ({describe_error(inner)})") from None

    def _older_intact(self, path: str) -> str | None:
        """The newest complete, intact checkpoint under this root older than `path` (same on every rank)."""
        older = [p for _, p in list_checkpoints(self.root) if os.path.basename(p) < os.path.basename(path)]
        return next((p for p in reversed(older) if intact(p) is None), None)

    def _verify_checksums(self, path: str, manifest: dict) -> None:
        files = sorted(manifest["files"])
        bad = [False] * len(files)
        for i in range(self.rank, len(files), self.world_size):
            bad[i] = sha256(os.path.join(path, files[i])) != manifest["files"][files[i]]["sha256"]
        bad = self._any(bad)
        if any(bad):
            names = [f for f, b in zip(files, bad) if b]
            raise CheckpointError(f"checkpoint {path}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
                                  "failed the checksum (corrupted on disk); use an earlier checkpoint")


def run_id_of(path: str) -> str | None:
    try:
        return read_manifest(path).get("run_id")
    except CheckpointError:
        return None


def commit(tmp: str, final: str, marker: dict) -> None:
    """Rename the finished directory into place, then write the marker: the checkpoint exists from then on."""
    old = None
    if os.path.exists(final):  # the same step from another attempt (e.g. resumed from an earlier checkpoint)
        old = os.path.join(os.path.dirname(final), TMP_PREFIX + "old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # a temporary name: never resumed from, cleared by the next save
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))
    write_json(os.path.join(final, MARKER), marker)
    fsync_dir(final)
    if old:
        shutil.rmtree(old, ignore_errors=True)
