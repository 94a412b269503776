"""One task of an emulated srun job (tests/test_dist_node.py): started as a plain process with the variables srun
sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, a per-task CUDA_VISIBLE_DEVICES) and its node's
HF cache (HF_HUB_CACHE). Only the hub is fake: huggingface_hub.snapshot_download copies files from a directory
standing in for the hub and logs each call. Writes what this rank found to $OUT/rank<r>.json."""
import fnmatch
import json
import os
import shutil
import sys
import time

import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError

HUB, LOG, OUT = sys.argv[1], sys.argv[2], sys.argv[3]


def fake_snapshot_download(repo_id, allow_patterns=None, ignore_patterns=None, **kw):
    with open(LOG, "a") as f:
        f.write(json.dumps({"node": os.environ["SLURM_NODEID"], "rank": int(os.environ["SLURM_PROCID"]),
                            "repo": repo_id, "allow": allow_patterns}) + "\n")
    src = os.path.join(HUB, repo_id)
    if not os.path.isdir(src):
        raise LocalEntryNotFoundError(f"{repo_id} is not in the cache and the hub is unreachable")
    time.sleep(1.0)  # a download takes a while: the node's other ranks must not go on before it ends
    snap = os.path.join(os.environ["HF_HUB_CACHE"], "models--" + repo_id.replace("/", "--"), "snapshots", "0" * 40)
    os.makedirs(snap)
    for name in os.listdir(src):
        if any(fnmatch.fnmatch(name, p) for p in allow_patterns) and \
                not any(fnmatch.fnmatch(name, p) for p in ignore_patterns or ()):
            shutil.copy(os.path.join(src, name), snap)
    with open(LOG, "a") as f:
        f.write(json.dumps({"node": os.environ["SLURM_NODEID"], "done": repo_id, "t": time.time()}) + "\n")
    return snap


huggingface_hub.snapshot_download = fake_snapshot_download
launch_env = dict(os.environ)

from spmdrl.config import load_config  # noqa: E402
from spmdrl.dist.init import init_distributed  # noqa: E402
from spmdrl.dist.node import device_index, gather_node_map  # noqa: E402
from spmdrl.errors import ConfigError  # noqa: E402
from spmdrl.hub import localise_models  # noqa: E402

env, device = init_distributed("cpu", 120)
nodes = gather_node_map()
cfg = load_config(None, ["model.path=org/tiny", "model.tokenizer_path=org/tok"])
local = localise_models(cfg)
returned = time.time()
try:
    localise_models(load_config(None, ["model.path=org/missing"]))
    error = None
except ConfigError as e:
    error = str(e)
visible = len(launch_env["CUDA_VISIBLE_DEVICES"].split(","))
with open(os.path.join(OUT, f"rank{env.rank}.json"), "w") as f:
    json.dump({
        "rank": env.rank, "world": env.world_size, "launcher": env.launcher, "local_rank": env.local_rank,
        "nodes": nodes.nodes, "node_local_rank": nodes.local_rank(env.rank),
        "device_index": device_index(launch_env, visible), "visible": launch_env["CUDA_VISIBLE_DEVICES"],
        "model_path": local.model.path, "tokenizer_path": local.model.tokenizer_path, "given_path": cfg.model.path,
        "returned": returned, "config_there": os.path.isfile(os.path.join(local.model.path, "config.json")),
        "error": error,
    }, f)
# every rank leaves together and tears its groups down (a gloo pair closed under a peer still running aborts it)
import torch.distributed as dist  # noqa: E402

dist.barrier()
dist.destroy_process_group()
