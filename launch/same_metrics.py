"""Compare the runs of two `launch/same_metrics.sh` outputs: every logged metric except wall-clock ones
(timing/, perf/, memory/) must be bitwise equal. Exit 1 and list the differences otherwise.

    python launch/same_metrics.py OUT_A OUT_B
"""
import sys

from spmdrl.metrics import read_jsonl

MEASURED = ("timing/", "perf/", "memory/", "weight_sync/transport_s")  # wall times and memory readings


def rows(path: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in read_jsonl(path)]


def main(a: str, b: str) -> int:
    ok = True
    for run in ("colocated", "resumed", "split"):
        ra, rb = rows(f"{a}/{run}/metrics.jsonl"), rows(f"{b}/{run}/metrics.jsonl")
        same = ra == rb
        print(f"{run}: {len(ra)} rows, {sum(map(len, ra))} values, bitwise identical: {same}")
        if not same:
            ok = False
            for x, y in zip(ra, rb):
                for k in sorted(set(x) | set(y)):
                    if x.get(k) != y.get(k):
                        print(f"  step {x.get('step')} {k}: {x.get(k)!r} != {y.get(k)!r}")
            if len(ra) != len(rb):
                print(f"  {len(ra)} rows against {len(rb)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
