"""Slurm and srun: the GPU a rank drives (spmdrl and vLLM agree), nodes, one hub download per node, host checks."""
import json
import os
import resource
import subprocess
import sys

import pytest

from spmdrl.dist.node import NodeMap, device_index, node_key, node_local_rank, nodes_in_job
from spmdrl.errors import ConfigError, LayoutError
from spmdrl.preflight import check_model_dir, gloo_address_problem, memlock_problem

GPUS = 8


def _srun_task(local: int, visible: str) -> dict:
    return {"SLURM_PROCID": str(8 + local), "SLURM_NTASKS": "16", "SLURM_LOCALID": str(local), "SLURM_NODEID": "1",
            "CUDA_VISIBLE_DEVICES": visible}


# What Slurm gives the 8 tasks of one 8-GPU node, as each task's CUDA_VISIBLE_DEVICES, under three bindings.
# Task t was given physical GPU t in all three.
BINDINGS = {
    "all GPUs visible (--gpus-per-node=8)": [",".join(map(str, range(GPUS)))] * GPUS,
    "own GPU (--gpus-per-task=1, --gpu-bind=single:1)": [str(t) for t in range(GPUS)],
    "socket's 4 GPUs (--gpu-bind=closest, block distribution)": ["0,1,2,3"] * 4 + ["4,5,6,7"] * 4,
}


class CudaVisibleDevices:
    """vLLM's own logical -> visible device mapping, with the variable its CUDA platform reads
    (vllm 0.32 platforms/cuda.py: CudaPlatformBase.device_control_env_var)."""

    def __init__(self):
        from vllm.platforms.interface import Platform

        self.platform = type("Cuda", (Platform,), {"device_control_env_var": "CUDA_VISIBLE_DEVICES"})


@pytest.mark.parametrize("binding", list(BINDINGS))
def test_spmdrl_and_vllm_drive_the_gpu_slurm_gave_the_task(binding, monkeypatch):
    """For each task: spmdrl's device index picks the physical GPU Slurm assigned it (distinct per task), and vLLM,
    given LOCAL_RANK = that index (what spmdrl.dist.init exports), passes its bound check and maps it to the
    same visible device (vllm 0.32 v1/worker/gpu_worker.py init_device: local_rank < device_count, then
    cuda:logical_device_id_to_visible_device_id(local_rank))."""
    vllm_map = CudaVisibleDevices().platform
    physical = []
    for task, visible in enumerate(BINDINGS[binding]):
        ids = visible.split(",")
        index = device_index(_srun_task(task, visible), len(ids))
        physical.append(int(ids[index]))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert index < len(ids)  # vLLM's assert
        assert vllm_map.logical_device_id_to_visible_device_id(index) == index
    assert physical == list(range(GPUS))


def test_device_index_torchrun_and_errors():
    assert device_index({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3"}, 8) == 3
    assert device_index({}, 1) == 0  # a world of one
    # torchrun under srun (launch/torchrun_slurm.sh): torchrun's LOCAL_RANK, not srun's SLURM_LOCALID (0)
    assert device_index({"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", **_srun_task(0, "0,1")}, 2) == 1
    with pytest.raises(LayoutError, match=r"LOCAL_RANK=5 but this process sees 4 GPU\(s\) \(CUDA_VISIBLE_DEVICES"
                                          r"=0,1,2,3\); start at most 4 ranks per node"):
        device_index({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4)
    with pytest.raises(LayoutError, match=r"sees none \(CUDA_VISIBLE_DEVICES=\)"):
        device_index(_srun_task(0, ""), 0)


def test_node_map_local_ranks_and_node_count():
    a = [_srun_task(t, "0") | {"SLURM_NODEID": "0"} for t in range(2)]
    b = [_srun_task(t, "0") | {"SLURM_NODEID": "1"} for t in range(2)]
    nodes = NodeMap.from_keys([node_key(e, "host") for e in a + b])  # one machine standing in for two nodes
    assert nodes.nodes == ((0, 1), (2, 3))
    assert [nodes.local_rank(r) for r in range(4)] == [node_local_rank(e) for e in a + b] == [0, 1, 0, 1]
    assert [nodes.leader(r) for r in range(4)] == [0, 0, 2, 2]
    # on a cluster the host names differ; ranks placed cyclically over two nodes
    cyclic = NodeMap.from_keys([node_key({}, h) for h in ("gpu1", "gpu2", "gpu1", "gpu2")])
    assert cyclic.nodes == ((0, 2), (1, 3)) and cyclic.local_rank(2) == 1 and cyclic.leader(3) == 1
    assert nodes_in_job({"SLURM_PROCID": "0", "SLURM_NTASKS": "32", "SLURM_NNODES": "4"}) == 4
    assert nodes_in_job({"RANK": "0", "WORLD_SIZE": "16", "GROUP_WORLD_SIZE": "2"}) == 2
    assert nodes_in_job({}) == 1


def test_host_checks():
    env = {}
    assert gloo_address_problem(env, 1, "h", ["127.0.1.1"]) is None  # one node: loopback is fine
    assert gloo_address_problem(env, 4, "h", ["10.0.0.5", "127.0.1.1"]) is None
    assert gloo_address_problem({"GLOO_SOCKET_IFNAME": "ib0"}, 4, "h", ["127.0.1.1"]) is None
    line = gloo_address_problem(env, 4, "gpu7", ["127.0.1.1"])
    assert "host name 'gpu7' resolves to 127.0.1.1" in line and "set GLOO_SOCKET_IFNAME" in line
    assert "does not resolve" in gloo_address_problem(env, 2, "gpu7", [])
    small, ib = 8 << 20, ["mlx5_0", "mlx5_1"]
    assert memlock_problem(env, 1, small, ib, "h") is None
    assert memlock_problem(env, 4, small, [], "h") is None  # no RDMA device: NCCL uses sockets
    assert memlock_problem({"NCCL_IB_DISABLE": "1"}, 4, small, ib, "h") is None
    assert memlock_problem(env, 4, resource.RLIM_INFINITY, ib, "h") is None
    line = memlock_problem(env, 4, small, ib, "gpu7")
    assert line.startswith("the locked-memory limit (ulimit -l) is 8192 KiB on gpu7") and "mlx5_0, mlx5_1" in line
    assert "\n" not in line


def test_check_host_reads_the_job_and_the_host(monkeypatch):
    """The preflight step every rank runs: a 2-node srun job on a host whose name resolves to loopback only."""
    import socket

    from spmdrl.config import load_config
    from spmdrl.preflight import check_host

    cfg = load_config(None, ["trainer.device=cpu"])
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    job = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2"}
    with pytest.raises(ConfigError, match=r"^this job spans 2 nodes and the host name 'localhost' resolves to 127\."):
        check_host(cfg, job)
    check_host(cfg, {**job, "GLOO_SOCKET_IFNAME": "lo"})
    check_host(cfg, {**job, "SLURM_NNODES": "1"})


@pytest.mark.parametrize("path", ["./models/none", "../none", "~/no-such-model", "/no/such/model", "a/b/c"])
def test_a_local_looking_path_that_is_missing_is_one_line(path):
    for key in ("critic.path", "reward.model_path"):
        with pytest.raises(ConfigError, match=rf"^{key} = '{path}': no such directory; give an HF model directory"):
            check_model_dir(key, path)
    assert check_model_dir("model.path", "org/name") is None  # a hub id: resolved after start-up (spmdrl.hub)


def test_localise_models_replaces_hub_ids_only(tmp_path, monkeypatch):
    import spmdrl.hub as hub
    from spmdrl.config import load_config, to_toml

    local_dir = tmp_path / "rm"
    local_dir.mkdir()
    calls = []
    monkeypatch.setattr(hub, "download", lambda repo, weights: calls.append((repo, weights)) or f"/snap/{repo}")
    cfg = load_config(None, ["model.path=org/pol", "critic.enable=true", "critic.path=org/pol",
                             "model.tokenizer_path=org/tok", f"reward.model_path={local_dir}"])
    out = hub.localise_models(cfg)  # no process group: a world of one downloads itself
    assert sorted(calls) == [("org/pol", True), ("org/tok", False)]  # once per id; a tokenizer without weights
    assert (out.model.path, out.critic.path, out.model.tokenizer_path) == ("/snap/org/pol",) * 2 + ("/snap/org/tok",)
    assert out.reward.model_path == str(local_dir)
    assert cfg.model.path == "org/pol" and "org/pol" in to_toml(cfg)  # what the run records stays as given


def test_two_node_srun_job(tmp_path):
    """4 processes with the variables srun sets for a 2-node job, 2 tasks per node, each task bound to its own
    GPU (a per-task CUDA_VISIBLE_DEVICES), each node with its own HF cache. Checks ranks, local ranks and device
    indices, and that each hub id is downloaded exactly once per node, by the node's first rank, while the
    node's other rank waits for it; a failed download is the same one-line error on every rank."""
    from launching import REPO, free_port

    hub, log, out = tmp_path / "hub", tmp_path / "calls.jsonl", tmp_path / "out"
    out.mkdir()
    for repo, files in {"org/tiny": ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"],
                        "org/tok": ["tokenizer.json", "tokenizer_config.json", "model.safetensors"]}.items():
        (hub / repo).mkdir(parents=True)
        for name in files:
            (hub / repo / name).write_text("{}")
        if "model.safetensors" in files:  # a whole (tensor-free) safetensors file: the download checks its header
            header = b'{"__metadata__":{}}'
            (hub / repo / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    base.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()), SLURM_NTASKS="4",
                SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77")
    procs = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
               "CUDA_VISIBLE_DEVICES": str(local), "HF_HUB_CACHE": str(tmp_path / f"node{node}" / "hub")}
        cmd = [sys.executable, "tests/dist_scripts/slurm_node.py", str(hub), str(log), str(out)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-3000:] for o in outs)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["world"], r["launcher"]) for r in ranks] == [(r, 4, "slurm") for r in range(4)]
    assert [r["local_rank"] for r in ranks] == [r["node_local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert all(r["nodes"] == [[0, 1], [2, 3]] for r in ranks)
    assert [r["device_index"] for r in ranks] == [0] * 4  # each task sees only its own GPU
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for repo, weights in (("org/tiny", True), ("org/tok", False), ("org/missing", True)):
        mine = [c for c in calls if c.get("repo") == repo]
        assert sorted((c["node"], c["rank"]) for c in mine) == [("0", 0), ("1", 2)]  # once per node, its first rank
        assert all(("*.safetensors" in c["allow"]) == weights for c in mine)
    done = {c["node"]: c["t"] for c in calls if "done" in c}  # the last download of each node
    for r in ranks:
        node = str(r["rank"] // 2)
        snap = tmp_path / f"node{node}" / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
        assert r["given_path"] == "org/tiny" and r["model_path"] == str(snap) and r["config_there"]
        assert r["tokenizer_path"].startswith(str(tmp_path / f"node{node}" / "hub" / "models--org--tok"))
        assert r["returned"] >= done[node]  # the second rank of a node waited for the first one's download
    assert sorted(os.listdir(tmp_path / "node0" / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40))) == \
        ["config.json", "model.safetensors", "tokenizer.json"]  # no other weight format
    errors = {r["error"] for r in ranks}
    assert errors == {
        "model.path = 'org/missing' is not a local directory and its download from the hub failed "
        "(LocalEntryNotFoundError: org/missing is not in the cache and the hub is unreachable); give a local model "
        "directory, or check the id, the network and HF_TOKEN"}
