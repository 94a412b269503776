"""A log of every process-group creation (SPMDRL_GROUP_LOG=<dir>), and NCCL's creation rules as a pure check.

With SPMDRL_GROUP_LOG=<dir> set, every rank writes <dir>/groups_rank<r>.jsonl: a first line about the run,

    {"rank": 2, "world_size": 4, "device_bound": false}

then one line per group creation, in the order this process made it, whoever made it (spmdrl's role meshes,
megatron-core's parallel state, vLLM's build):

    {"seq": 7, "api": "new_group", "ranks": [0, 1], "local": true, "member": true, "name": "8f1e...",
     "backend": "gloo", "caller": "vllm", "site": "vllm/distributed/parallel_state.py:1219"}

`local`: the creation synchronised only the group's members (`use_local_synchronization=True`); otherwise it
is a collective over the world. `caller`: vllm, megatron or spmdrl, the first of them found on the stack;
`site`: the innermost line of that caller; `via`: "DeviceMesh" when a torch DeviceMesh made the call.
`device_bound`: what `spmdrl.dist.init.binds_device` (the function `init_distributed` asks) answers for this
run, i.e. whether a CUDA run of the same configuration binds the default group to its device; it decides
which of NCCL's rules the run must follow, and the log records it on CPU runs too.

The hook sits under every public entry point: `torch.distributed.new_group` (what megatron-core, vLLM and
DeviceMesh call, also through `rollout/vllm_world.py`'s stand-in for the attribute) goes through
`distributed_c10d._new_group_with_tag`, which is wrapped; `split_group` (DeviceMesh's route on CUDA when the
default group is device-bound) is wrapped in distributed_c10d and in device_mesh, which imports it by name.

`check_nccl_rules` says which creations a CUDA run of the logged sequence would hang on (torch 2.13,
distributed_c10d.py):
  * device-bound: torch creates every NCCL group by `ncclCommSplit` of the world communicator, a collective
    that every world rank joins, non-members with a no-colour split (`_new_process_group_helper`); a
    member-local creation returns on non-members before that split (`_new_group_with_tag`). So every rank
    makes the same creations in the same order, and none is member-local unless it spans the world.
  * not bound: NCCL groups connect their members at their first collective (`ncclCommInitRank`), under the
    group's name. A world-synchronised creation is named by a counter every rank advances
    (`_process_group_name`), so every rank makes the same sequence of those; a member-local one is named by a
    hash of its ranks and of how many groups the process holds (`_hash_ranks_to_str`), so its members make
    it in the same order relative to the other creations they take part in, and agree on its name.
  * `split_group` is a collective over the parent group's ranks.
  * device-bound, the world communicator's splits are matched by order across ranks, and a group created
    with the gloo backend makes its non-members split (with no colour) while its members do not: a family of
    gloo groups (vLLM's CPU groups, megatron-core's) is balanced only when it partitions the world.
A CPU log cannot tell which groups a CUDA run makes NCCL (they are all gloo here): every group is checked
as if it were NCCL, as vLLM's and megatron-core's device groups are, except those created with an explicit
gloo backend.

First use. Each rank also writes one line per group the first time it makes a collective or a batched
point-to-point call (`batch_isend_irecv`) on it, the default group included:

    {"use": "8f1e...", "op": "batch_isend_irecv", "ranks": [0, 1, 2, 3], "peers": [2], "tags": [0],
     "caller": "spmdrl", "site": "spmdrl/reshard/transport.py:97"}

(`ranks`: the group's members; `peers` and `tags`: the global ranks and tags of the batch's operations.)
`check_first_use` says which groups a CUDA run would hang on at their first use: with the default group not
bound to a device, an NCCL group has no communicator until its first collective or batched point-to-point
call, which creates one (`ncclCommInitRank` over the group's members) and so must be made by every member
(torch 2.13, the note in `batch_isend_irecv`'s docstring: "if this API is the first collective call in the
group ..., all ranks of the group must participate in this API call"). A member that skips that call (it has
nothing to send in the first bucket, say) leaves the others waiting in the communicator's creation. Single
`send`/`recv` calls are not recorded: NCCL connects the two ranks of such a call on their own. Calls that do
not go through torch.distributed's Python functions (torch's functional collectives, which DTensor's
redistribution uses) are not seen.
"""
from __future__ import annotations

import glob
import inspect
import json
import os
import sys

import torch
import torch.distributed as dist

ENV = "SPMDRL_GROUP_LOG"
CALLERS = ("vllm", "megatron", "spmdrl")  # the first of these on the stack names the caller

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SPMDRL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_state: dict = {"file": None, "rank": 0, "seq": 0, "originals": None, "used": set()}
# the calls whose first use of a group connects a lazily connected NCCL group (torch.distributed's names)
USES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
        "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
        "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
        "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "batch_isend_irecv")


# ---- recording -------------------------------------------------------------------------------------------
def start_group_log(rank: int, world_size: int, device_bound: bool, directory: str | None = None) -> str | None:
    """Start logging this rank's group creations to <directory>/groups_rank<rank>.jsonl (directory: the
    SPMDRL_GROUP_LOG environment variable when not given; nothing happens when neither is set). Returns the
    file's path."""
    directory = directory or os.environ.get(ENV)
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"groups_rank{rank}.jsonl")
    if _state["file"] is not None:
        _state["file"].close()
    _state.update(file=open(path, "w", buffering=1), rank=rank, seq=0, used=set())
    _write({"rank": rank, "world_size": world_size, "device_bound": bool(device_bound)})
    if _state["originals"] is None:
        _install()
    return path


def stop_group_log() -> None:
    """Close the log and give torch back its own functions."""
    from torch.distributed import device_mesh, distributed_c10d as c10d

    if _state["file"] is not None:
        _state["file"].close()
        _state["file"] = None
    if _state["originals"] is not None:
        originals = _state["originals"]
        c10d._new_group_with_tag, c10d.split_group, device_mesh.split_group = originals["creation"]
        for name, fn in originals["uses"].items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        _state["originals"] = None


def _write(row: dict) -> None:
    _state["file"].write(json.dumps(row) + "\n")


def _install() -> None:
    from torch.distributed import device_mesh, distributed_c10d as c10d

    new_group_with_tag, split_group = c10d._new_group_with_tag, c10d.split_group
    _state["originals"] = {"creation": (new_group_with_tag, split_group, device_mesh.split_group), "uses": {}}
    bind_new, bind_split = inspect.signature(new_group_with_tag).bind, inspect.signature(split_group).bind

    def logged_new_group_with_tag(*args, **kwargs):
        pg = new_group_with_tag(*args, **kwargs)
        a = bind_new(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        ranks = list(range(c10d._get_default_group().size())) if a["ranks"] is None else list(a["ranks"])
        _record("new_group", sorted(ranks) if a.get("sort_ranks", True) else ranks,
                bool(a.get("use_local_synchronization")), a.get("backend"), pg)
        return pg

    def logged_split_group(*args, **kwargs):
        pg = split_group(*args, **kwargs)
        a = bind_split(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        parent = a.get("parent_pg") or c10d._get_default_group()
        to_global = c10d.get_process_group_ranks(parent)  # group rank -> global rank
        splits = [sorted(to_global[r] for r in s) for s in a["split_ranks"]]
        mine = next((s for s in splits if _state["rank"] in s), [])
        _record("split_group", mine, False, a.get("backend"), pg, parent=sorted(to_global), splits=splits)
        return pg

    c10d._new_group_with_tag = logged_new_group_with_tag
    c10d.split_group = logged_split_group
    device_mesh.split_group = logged_split_group  # imported there by name
    for name in USES:
        original = getattr(c10d, name, None)
        if original is not None:
            _state["originals"]["uses"][name] = original
            # callers reach these as torch.distributed.<name> (FSDP2, megatron-core, vLLM, spmdrl) or from inside
            # distributed_c10d (the object collectives): both names are replaced
            wrapped = _logged_use(name, original)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)


def _logged_use(name: str, fn):
    bind = inspect.signature(fn).bind

    def logged(*args, **kwargs):
        if _state["file"] is not None:
            try:
                if name == "batch_isend_irecv":
                    ops = list(args[0] if args else kwargs["p2p_op_list"])
                    if ops:
                        _record_use(name, ops[0].group, peers=sorted({op.peer for op in ops}),
                                    tags=sorted({op.tag for op in ops}))
                else:
                    a = bind(*args, **kwargs).arguments
                    _record_use(name, a.get("group"))
            except (TypeError, KeyError, IndexError):
                pass  # a call torch itself will reject: nothing to record
        return fn(*args, **kwargs)

    logged.__wrapped__ = fn
    return logged


def _record_use(op: str, group, **extra) -> None:
    """One line the first time this rank calls a collective or a batched point-to-point call on `group`."""
    from torch.distributed import distributed_c10d as c10d

    if c10d._rank_not_in_group(group):
        return  # torch returns at once on a non-member
    pg = group if group is not None else c10d._get_default_group()
    name = pg.group_name
    if name in _state["used"]:
        return
    _state["used"].add(name)
    caller, site, via = _caller(sys._getframe(2))
    row = {"use": name, "op": op, "ranks": sorted(dist.get_process_group_ranks(pg)), **extra,
           "caller": caller, "site": site}
    if via:
        row["via"] = via
    _write(row)


def _record(api: str, ranks: list[int], local: bool, backend, pg, **extra) -> None:
    if _state["file"] is None:
        return
    caller, site, via = _caller(sys._getframe(2))
    row = {"seq": _state["seq"], "api": api, "ranks": ranks, "local": local, "member": _state["rank"] in ranks,
           "name": pg.group_name if isinstance(pg, dist.ProcessGroup) else None,
           "backend": None if backend is None else str(backend), "caller": caller, "site": site, **extra}
    if via:
        row["via"] = via
    _state["seq"] += 1
    _write(row)


def _caller(frame) -> tuple[str, str | None, str | None]:
    """(the first of CALLERS on the stack or "other", its innermost file:line, "DeviceMesh" when torch's
    DeviceMesh made the call)."""
    innermost: dict[str, str] = {}
    via = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_TORCH_DIR):
            if path.endswith("device_mesh.py"):
                via = "DeviceMesh"
        elif path != __file__:
            lib = _library(path)
            innermost.setdefault(lib, f"{_short(path, lib)}:{frame.f_lineno}")
        frame = frame.f_back
    lib = next((c for c in CALLERS if c in innermost), "other")
    return lib, innermost.get(lib), via


def _library(path: str) -> str:
    if path.startswith(_SPMDRL_DIR):
        return "spmdrl"
    parts = path.split(os.sep)
    return next((c for c in ("vllm", "megatron") if c in parts), "other")


def _short(path: str, lib: str) -> str:
    parts = path.split(os.sep)
    return "/".join(parts[len(parts) - 1 - parts[::-1].index(lib):]) if lib in parts else os.path.basename(path)


# ---- reading and checking --------------------------------------------------------------------------------
def read_group_logs(directory: str) -> tuple[dict[int, list[dict]], bool]:
    """({rank: its rows in order: creations ("api") and first uses ("use")}, device_bound) from the files
    `start_group_log` wrote in directory."""
    logs, heads = {}, {}
    for path in glob.glob(os.path.join(directory, "groups_rank*.jsonl")):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        heads[rows[0]["rank"]] = rows[0]
        logs[rows[0]["rank"]] = rows[1:]
    if not heads:
        raise FileNotFoundError(f"no groups_rank*.jsonl in {directory}: was {ENV} set for the run?")
    world = {h["world_size"] for h in heads.values()}
    bound = {h["device_bound"] for h in heads.values()}
    if len(world) != 1 or len(bound) != 1 or sorted(logs) != list(range(next(iter(world)))):
        raise ValueError(f"{directory}: the group logs are not one run's (ranks {sorted(logs)}, world sizes "
                         f"{sorted(world)}, device_bound {sorted(bound)})")
    return logs, bound.pop()


def check_nccl_rules(logs_by_rank: dict[int, list[dict]], device_bound: bool) -> list[str]:
    """Violations of NCCL's group-creation rules (see the module docstring) by the logged creations, one line
    each; empty when a CUDA run making them (device-bound or not) would not hang creating its groups."""
    world = sorted(logs_by_rank)
    everyone = frozenset(world)
    out: list[str] = []
    logs_by_rank = {r: [row for row in rows if "api" in row] for r, rows in logs_by_rank.items()}  # creations only

    def takes_part(row: dict, rank: int) -> frozenset:
        """The ranks that take part in the creation `rank` logged (none: the call returned at once)."""
        if row["api"] == "split_group":
            return frozenset(row["parent"])
        if not row["local"]:
            return everyone
        if rank not in row["ranks"]:  # member-local, not a member: torch returns before anything
            return frozenset()
        return everyone if device_bound else frozenset(row["ranks"])

    if device_bound:
        seen = set()
        for rank in world:
            for row in logs_by_rank[rank]:
                key = (tuple(row["ranks"]), row.get("site"))
                if takes_part(row, rank) and row["local"] and frozenset(row["ranks"]) != everyone and key not in seen:
                    seen.add(key)
                    out.append(f"group {row['ranks']} is created member-local ({_who(row)}) while the default group is "
                               "device-bound: its members split the world communicator, which the other ranks never join")
        out += _unbalanced_splits(logs_by_rank, world)
    why = ("with a device-bound default group every creation splits the world communicator, joined by every rank "
           "in order" if device_bound else
           "world-synchronised creations are numbered alike on every rank, member-local ones named alike by their members")
    for i, a in enumerate(world):
        for b in world[i + 1:]:
            pair = {a, b}
            seq_a = [row for row in logs_by_rank[a] if pair <= takes_part(row, a)]
            seq_b = [row for row in logs_by_rank[b] if pair <= takes_part(row, b)]
            for k in range(max(len(seq_a), len(seq_b))):
                ra = seq_a[k] if k < len(seq_a) else None
                rb = seq_b[k] if k < len(seq_b) else None
                if ra is None or rb is None or _key(ra) != _key(rb):
                    out.append(f"ranks {a} and {b} differ at the creation {k + 1} they both take part in: rank {a} "
                               f"{_creates(ra)}, rank {b} {_creates(rb)} ({why})")
                    break
                if (not device_bound and pair <= set(ra["ranks"]) and ra.get("name") and rb.get("name")
                        and ra["name"] != rb["name"]):
                    out.append(f"group {ra['ranks']} has the name {ra['name']} on rank {a} and {rb['name']} on rank "
                               f"{b}: its NCCL communicator would be looked up under different store keys")
                    break
    return out


def _world_splits(rows: list[dict], rank: int) -> list[tuple]:
    """The splits of the world communicator `rank` makes for its logged creations while the default group is
    device-bound (torch 2.13, `_new_process_group_helper`): a member of a new NCCL group splits with the
    group's colour; a non-member splits with no colour whatever the new group's backend, gloo included; a
    member of a gloo group does not split at all. [(the group's ranks, or None for no colour, the row)]."""
    out = []
    for row in rows:
        if row.get("api") != "new_group":
            continue
        member = rank in row["ranks"]
        if row["local"] and not member:
            continue  # torch returns before anything (reported above)
        if member and str(row.get("backend")).lower() == "gloo":
            continue
        out.append((tuple(row["ranks"]) if member else None, row))
    return out


def _unbalanced_splits(logs_by_rank: dict[int, list[dict]], world: list[int]) -> list[str]:
    """The world communicator's splits are collectives matched by order: the k-th split of every rank is one
    call, in which the ranks giving a group's colour must be exactly that group's members. Gloo groups break
    the balance (their non-members split, their members do not) unless each family of them partitions the
    world, so that every rank is a non-member of as many of them as every other."""
    splits = {r: _world_splits(logs_by_rank[r], r) for r in world}
    for k in range(max(len(s) for s in splits.values())):
        colours: dict[tuple, list[int]] = {}
        done = [r for r in world if k >= len(splits[r])]
        for r in world:
            if k < len(splits[r]) and splits[r][k][0] is not None:
                colours.setdefault(splits[r][k][0], []).append(r)
        wrong = next(((g, rs) for g, rs in colours.items() if sorted(rs) != list(g)), None)
        if wrong or (done and len(done) < len(world)):
            def doing(r):
                if k >= len(splits[r]):
                    return "makes no more splits"
                g, row = splits[r][k]
                what = f"splits for {list(g)}" if g else f"splits with no colour as a non-member of {row['ranks']}"
                return f"{what} ({row.get('backend') or 'default'} backend, {_who(row)})"
            detail = "; ".join(f"rank {r} {doing(r)}" for r in world)
            return [f"the world communicator's split {k + 1} does not match across ranks: {detail} (device-bound: "
                    "a gloo group's non-members split with no colour and its members do not, so a family of gloo "
                    "groups must partition the world)"]
    return []


def _key(row: dict) -> tuple:
    if row["api"] == "split_group":
        return "split_group", tuple(row["parent"]), tuple(map(tuple, row["splits"]))
    return "new_group", tuple(row["ranks"]), row["local"]


def _who(row: dict) -> str:
    via = f" via {row['via']}" if row.get("via") else ""
    return f"{row.get('caller', '?')} at {row.get('site') or '?'}{via}"


def _creates(row: dict | None) -> str:
    if row is None:
        return "makes no more"
    kind = "split of " + str(row["parent"]) if row["api"] == "split_group" else (
        "member-local" if row["local"] else "world-synchronised")
    return f"creates {row['ranks']} ({kind}, {_who(row)})"


def check_first_use(logs_by_rank: dict[int, list[dict]], device_bound: bool) -> list[str]:
    """Violations of NCCL's first-use rule (see the module docstring) by the logged first uses, one line each;
    empty when no group's first collective or batched point-to-point call leaves a member out. With a
    device-bound default group every NCCL group is connected at its creation, so there is nothing to check.
    Groups created with an explicit gloo backend are skipped (gloo connects nothing lazily)."""
    if device_bound:
        return []
    gloo = {row["name"] for rows in logs_by_rank.values() for row in rows
            if "api" in row and str(row.get("backend")).lower() == "gloo" and row.get("name")}
    firsts: dict[str, dict[int, dict]] = {}
    for rank, rows in logs_by_rank.items():
        for row in rows:
            if "use" in row and row["use"] not in gloo:
                firsts.setdefault(row["use"], {})[rank] = row
    out: list[str] = []
    for name, first in firsts.items():
        members = next(iter(first.values()))["ranks"]
        absent = sorted(set(members) - set(first))
        if absent:
            r0 = min(first)
            out.append(f"group {members}: ranks {absent} never call a collective on it, while ranks {sorted(first)} "
                       f"make their first call on it ({_call(first[r0])}): that call creates the group's NCCL "
                       "communicator and waits for every member")
            continue
        kinds: dict[tuple, list[int]] = {}
        for rank, row in sorted(first.items()):
            kinds.setdefault((row["op"], row.get("site"), tuple(row.get("tags", ()))), []).append(rank)
        if len(kinds) > 1:
            out.append(f"group {members}: its members' first calls differ: " + "; ".join(
                f"ranks {ranks} {_call(first[ranks[0]])}" for ranks in kinds.values())
                + ": the first call on a lazily connected NCCL group must be one call of every member")
            continue
        for rank, row in sorted(first.items()):
            lone = [p for p in row.get("peers", ()) if rank not in first[p].get("peers", ())]
            if lone:
                out.append(f"group {members}: rank {rank}'s first call ({_call(row)}) exchanges with ranks {lone}, "
                           f"whose first calls do not include rank {rank}: they are different calls, so rank {rank}'s "
                           "first call is not made by every member")
                break
    return out


def _call(row: dict) -> str:
    peers = f" with {row['peers']}" if "peers" in row else ""
    tags = f" tag {row['tags']}" if row.get("tags") not in (None, [0]) else ""
    return f"{row['op']}{peers}{tags}, {_who(row)}"
