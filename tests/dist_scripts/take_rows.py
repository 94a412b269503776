"""take_global_rows on gloo: rank r holds 2 + 3r rows of ragged width; every rank takes its slice of the
concatenation. Writes <out>/rows_rank{r}.pt."""
import os
import sys

import torch
import torch.distributed as dist


def local_rows(rank: int):
    n, w = 2 + 3 * rank, 3 + rank
    ids = torch.arange(n) + 100 * rank
    return {"uid": ids, "tok": ids[:, None] * 10 + torch.arange(w)[None], "f": ids.float() / 7}


def main():
    from spmdrl.batch import Batch
    from spmdrl.dist.collectives import take_global_rows

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    b = Batch(local_rows(rank))
    per = 3  # 2 + 5 = 7 rows in all: rank 0 takes rows 0..2 (two of its own, one of rank 1), rank 1 rows 3..5
    out = take_global_rows(b, rank * per, (rank + 1) * per, group=dist.group.WORLD)
    torch.save(dict(out.tensors), os.path.join(sys.argv[1], f"rows_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    from spmdrl.process.launcher import leave  # no interpreter teardown: seconds per rank

    leave(main())
