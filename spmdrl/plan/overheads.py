"""What a GPU rank holds besides model state and activations: the CUDA context, NCCL's buffers and vLLM's
memory outside its sleep pool. Each figure is a named constant with its source; they are estimates, and
`spmdrl plan` prints them per phase so a measured run can be compared.

NCCL. Every process group a rank joins is an NCCL communicator of its own (torch binds the device in
`init_process_group`, so `new_group` creates them eagerly; spmdrl/dist/init.py). What a communicator costs is its
connection buffers: per channel and connected peer one FIFO per protocol, NCCL's defaults in src/init.cc:
Simple `DEFAULT_BUFFSIZE` 4 MiB, LL128 `DEFAULT_LL128_BUFFSIZE` 120 x 640 x 8 x 8 B, LL `DEFAULT_LL_BUFFSIZE`
8 x 512 x 8 x 16 B. A ring connects one peer per channel, and NCCL runs 32 collective channels between the
NVLink-connected GPUs of an 8 x H100 node (NCCL INFO logs, NVIDIA/nccl issue 1685). So a communicator that runs
a collective holds NCCL_COMM_BYTES = 32 x 9.19 MiB = 294 MiB. Counted for every communicator a rank creates:
NCCL >= 2.22 connects at the first collective, so for one that never runs a collective this is an upper
bound; tree and NVLS (NVLink SHARP) connections on all-reduce communicators add to it and are not counted.
Point-to-point (the weight sync, megatron's pipeline) connects per peer: NVIDIA/nccl issue 1685 measured
(4.34 - 1.06) GB for the 7 peers of an all-to-all in one 8 x H100 node, NCCL_NVLINK_PEER_BYTES per peer; a peer
on another node uses NCCL_NCHANNELS_PER_NET_PEER (default 2) channels.

vLLM (0.32.0, `enable_sleep_mode`). Sleep releases the cuMem pool (tags weights and kv_cache) and moves the
"runtime" tag to host (device_allocator/sleep_mode_backend.py: CuMemBackend.suspend). What stays on the GPU
while training runs:
  * the CUDA graph pool: graphs are captured into torch's graph pool, not cuMem, unless
    model_config.sleep_mode_offload_cudagraph (default False; compilation/cudagraph_pool.py capture_pool).
    vLLM measures it at start-up (v1/worker/gpu_worker.py determine_available_memory ->
    profile_cudagraph_memory, logged as "Estimated CUDA graph memory"); the plan assumes VLLM_CUDAGRAPH_BYTES.
    None with rollout.enforce_eager.
  * the model runner's persistent input buffers, allocated in GPUModelRunner.__init__ outside any pool
    (v1/worker/gpu_model_runner.py: input_ids, positions, inputs_embeds [max_num_tokens, hidden], ...):
    max_num_batched_tokens x (hidden x dtype bytes + VLLM_RUNNER_INT_BYTES_PER_TOKEN).
  * with TP > 1, the all-reduce buffers allocated with cudaMalloc when the TP group is built, before vLLM
    measures the free memory, so outside its gpu_memory_utilization budget even while awake: the custom
    all-reduce IPC buffers (distributed/device_communicators/custom_all_reduce.py: max(max_size, 2 MiB
    all-gather, 16 MiB reduce-scatter) + meta + 8 MiB rank_data; max_size 256 KiB at 8 ranks on sm90,
    all_reduce_utils.py) and torch symmetric memory (symm_mem.py, SYMM_MEM_ALL_REDUCE_MAX_SIZES: 64 MiB on sm90).
While awake, vLLM's pool plus these (but the all-reduce buffers) stay within gpu_memory_utilization x GPU: vLLM
sizes its KV cache to what the weights, the profiled activations and the graph estimate leave.
"""
from __future__ import annotations

GIB = 2**30
MIB = 2**20

CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspaces, kernel images; outside torch's allocator, NCCL not included
PROCESS_HOST_GIB = 6.0  # one rank's host process: interpreter, torch/CUDA/vLLM libraries, tokenizer, data

NCCL_SIMPLE_BYTES = 1 << 22  # DEFAULT_BUFFSIZE
NCCL_LL128_BYTES = 120 * 640 * 8 * 8  # DEFAULT_LL128_BUFFSIZE: ELEMS_PER_THREAD x MAX_NTHREADS x NCCL_STEPS x 8
NCCL_LL_BYTES = 8 * 512 * 8 * 16  # DEFAULT_LL_BUFFSIZE: LINES_PER_THREAD x MAX_NTHREADS x NCCL_STEPS x 16
NCCL_CHANNEL_BYTES = NCCL_SIMPLE_BYTES + NCCL_LL128_BYTES + NCCL_LL_BYTES  # one connected peer, all protocols
NCCL_CHANNELS = 32  # collective channels between NVLink-connected H100s
NCCL_COMM_BYTES = NCCL_CHANNELS * NCCL_CHANNEL_BYTES  # a communicator's ring (294 MiB)
NCCL_NVLINK_PEER_BYTES = (4_340_000_000 - 1_060_000_000) // 7  # point-to-point, per peer in the same node
NCCL_NET_CHANNELS_PER_PEER = 2  # NCCL_NCHANNELS_PER_NET_PEER default
NCCL_NET_PEER_BYTES = NCCL_NET_CHANNELS_PER_PEER * NCCL_CHANNEL_BYTES  # point-to-point, per peer on another node

VLLM_CUDAGRAPH_BYTES = 1 * GIB  # allowance; compare vLLM's "Estimated CUDA graph memory" log line
VLLM_RUNNER_INT_BYTES_PER_TOKEN = 64  # input_ids, positions, req_indices, is_token_ids, ... per token
VLLM_CUSTOM_AR_BYTES = 16 * MIB + 256 * 1024 + 8 * MIB  # buffer (16 MiB reduce-scatter) + meta + rank_data
VLLM_SYMM_MEM_BYTES = 64 * MIB


# ------------------------------------------------------------------------------------------------ NCCL

def megatron_groups(tp: int, pp: int, dp: int, ep: int = 1) -> dict[str, int]:
    """Sizes of the NCCL groups megatron-core 0.16.1's `initialize_model_parallel` gives each rank (cp = 1, expert
    tp = tp, one distributed-optimizer instance; parallel_state.py, in creation order). The expert groups come
    from its second rank generator over tp x ep x pp x (dp / ep)."""
    return {"dp-cp": dp, "dp": dp, "cp": 1, "tp-pp": tp * pp, "tp": tp, "pp": pp, "embedding": 2 if pp > 1 else 1,
            "position-embedding": 1, "tp-dp-cp": tp * dp, "tp-dp": tp * dp, "tp-cp": tp, "ep": ep, "expert-tp": tp,
            "tp-ep": tp * ep, "tp-ep-pp": tp * ep * pp, "expert-dp": dp // ep, "intra-dist-opt": tp * pp * dp}


def communicators(layout: dict, backends: dict, world: int, split: bool, rollout_shards: bool) -> dict[int, dict]:
    """Per global rank: how many NCCL communicators of two or more ranks it creates, by who creates them.
      world        init_process_group
      role_meshes  one DeviceMesh per distinct (ranks, dp, pp, sp, tp) of every role (spmdrl/dist/meshes.py), a
                   group per dimension; a dimension spanning the whole world reuses the world group (torch's
                   DeviceMesh); with sp > 1 also FSDP2's flattened dp x sp group
      split_groups split placement: batch and weight groups (whole world), the training ranks' group
      megatron     megatron's parallel state (`megatron_groups`), when a role runs on the Megatron backend
      vllm         vLLM's world group over the rollout ranks, and per TP group a torch device group plus
                   vLLM's own PyNccl communicator (vllm/distributed/parallel_state.py, cuda_communicator.py)"""
    from spmdrl.dist.layout import TRAINED_ROLES

    out = {r: {"world": int(world > 1), "role_meshes": 0, "split_groups": 0, "megatron": 0, "vllm": 0}
           for r in range(world)}
    seen = set()
    for lay in layout.values():
        key = (lay.ranks, lay.dp, lay.pp, lay.sp, lay.tp)
        if key in seen:
            continue
        seen.add(key)
        for kind, groups in lay.groups().items():
            if kind in ("ep_groups", "edp_groups"):  # megatron's own groups (below), not a DeviceMesh dimension
                continue
            for g in groups:
                if 1 < len(g) < world:
                    for r in g:
                        out[r]["role_meshes"] += 1
        if lay.sp > 1:  # FSDP2's flattened dp x sp group (RoleMesh.shard_mesh), a new group even over the world
            for r in lay.ranks:
                out[r]["role_meshes"] += 1
    if split:
        for r in range(world):
            out[r]["split_groups"] = 2 + int(r in layout["actor"].ranks and len(layout["actor"].ranks) > 1)
    mega = [role for role in TRAINED_ROLES if backends.get(role) == "megatron"]
    if mega:
        a = layout[mega[0]]
        n = sum(1 for size in megatron_groups(a.tp, a.pp, a.dp, a.ep).values() if size > 1)
        for r in a.ranks:
            out[r]["megatron"] = n
    if rollout_shards:  # vLLM (the transformers fallback creates no groups)
        ro = layout["rollout"]
        for r in ro.ranks:
            out[r]["vllm"] = int(len(ro.ranks) > 1) + (2 if ro.tp > 1 else 0)
    return out


def p2p_peers(plan, gpus_per_node: int) -> dict[int, tuple[int, int]]:
    """Per rank: (peers in its node, peers on other nodes) it exchanges weight-sync blocks with."""
    peers: dict[int, set[int]] = {}
    for ts in plan.transfers.values():
        for t in ts:
            if t.src != t.dst:
                peers.setdefault(t.src, set()).add(t.dst)
                peers.setdefault(t.dst, set()).add(t.src)
    return {r: _split_by_node(r, ps, gpus_per_node) for r, ps in peers.items()}


def _split_by_node(rank: int, others, gpus_per_node: int) -> tuple[int, int]:
    """(how many of `others` share rank's node, how many do not)."""
    from spmdrl.dist.layout import node_of

    same = sum(node_of(o, gpus_per_node) == node_of(rank, gpus_per_node) for o in others)
    return same, len(others) - same


def nccl_bytes(comms: dict, peers: tuple[int, int], pipeline_peers: tuple[int, int] = (0, 0)) -> dict[str, int]:
    """A rank's NCCL memory: its communicators' ring buffers, and its point-to-point connections (weight-sync
    peers; pipeline neighbours) per peer, in the node or across nodes."""
    intra, inter = peers[0] + pipeline_peers[0], peers[1] + pipeline_peers[1]
    return {"nccl_communicators": sum(comms.values()) * NCCL_COMM_BYTES,
            "nccl_p2p": intra * NCCL_NVLINK_PEER_BYTES + inter * NCCL_NET_PEER_BYTES}


def pipeline_peers(lay, rank: int, gpus_per_node: int) -> tuple[int, int]:
    """(in-node, other-node) pipeline neighbours of a rank of a Megatron role (p2p sends of 1F1B)."""
    c = lay.coords(rank)
    if c is None or lay.pp == 1:
        return 0, 0
    g = lay.mesh_ranks()[c[0]]
    return _split_by_node(rank, {g[p][c[2]] for p in (c[1] - 1, c[1] + 1) if 0 <= p < lay.pp}, gpus_per_node)


# ------------------------------------------------------------------------------------------------ vLLM

def vllm_outside_pool(cfg, hf, tp: int, elem_bytes: int) -> dict[str, int]:
    """vLLM's device memory outside its cuMem pool, per rollout rank (see the module docstring). The graph pool
    and the runner's buffers are inside its gpu_memory_utilization budget while it is awake; the all-reduce
    buffers never are."""
    r = cfg.rollout
    return {
        "vllm_cudagraph_pool": 0 if r.enforce_eager else VLLM_CUDAGRAPH_BYTES,
        "vllm_runner_buffers": r.max_num_batched_tokens * (hf.hidden_size * elem_bytes + VLLM_RUNNER_INT_BYTES_PER_TOKEN),
        "vllm_allreduce_buffers": (VLLM_CUSTOM_AR_BYTES + VLLM_SYMM_MEM_BYTES) if tp > 1 else 0,
    }
