"""reduce_mean on 2 gloo ranks: same keys (the one-all-reduce path) and different keys (the rare path)."""
import json
import sys

import torch.distributed as dist

from spmdrl.dist.collectives import reduce_mean


def main():
    dist.init_process_group("gloo")
    r = dist.get_rank()
    out = {
        "same": reduce_mean({"a": 1.0 + r, "b": 10.0 * (r + 1)}),
        "weighted": reduce_mean({"a": 1.0 + r}, weight=1.0 if r == 0 else 3.0),
        "different": reduce_mean({"a": 2.0 + r, **({"only1": 5.0} if r == 1 else {})}),
        "empty_vs_one": reduce_mean({} if r == 0 else {"x": 4.0}),
    }
    if r == 0:
        json.dump(out, open(sys.argv[1], "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
