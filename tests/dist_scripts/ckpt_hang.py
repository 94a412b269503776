"""Two ranks: rank 1 hangs (never reaches the collective), rank 0 must give up after the timeout given on the
command line, with an error naming the step and stage. The collective runs on a subgroup, which torch would
otherwise create with its 30-minute default timeout."""
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    from spmdrl.dist.init import init_distributed
    from spmdrl.errors import SpmdrlError
    from spmdrl.faults import inject_fault, named_failures, set_collective_timeout
    from spmdrl.metrics import StageTimer

    timeout = float(sys.argv[1])
    env, _ = init_distributed("cpu", 600.0)
    group = dist.new_group([0, 1])
    set_collective_timeout(timeout)
    dist.barrier()
    timer = StageTimer()
    t0 = time.perf_counter()
    try:
        with named_failures(lambda: 3, timeout):
            if env.rank == 1:
                inject_fault("hang", env.rank, 3, None)
            with timer("update_actor"):
                dist.all_reduce(torch.ones(1), group=group)
    except SpmdrlError as e:
        print(f"error (rank {env.rank}) after {time.perf_counter() - t0:.1f}s: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
