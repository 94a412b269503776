"""Cost of a tool call through the runner: the calculator in a thread of this process (a Tool built in
Python, as every tool ran before tool workers) against the same calculator in tool worker processes (loaded
from its multi_turn.tools spec, as a run does now).

    python launch/bench_tool_calls.py [--turns 200] [--calls 1 16]

Prints, per turn size, the mean wall time of a turn and of a call in it; the first turn (worker start) is
left out of the timing and printed on its own."""
from __future__ import annotations

import argparse
import dataclasses
import time

from spmdrl.tools.base import ToolCall
from spmdrl.tools.registry import load_tool
from spmdrl.tools.runner import ThreadToolRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    in_worker = load_tool("calculator")
    in_thread = dataclasses.replace(in_worker, spec="")
    for calls in args.calls:
        turn = [[ToolCall("calculator", {"expression": f"1234567+89012+{i}"})] for i in range(calls)]
        for label, tool in (("thread", in_thread), ("worker", in_worker)):
            runner = ThreadToolRunner([tool], timeout_s=10, max_parallel=16)
            t0 = time.perf_counter()
            runner.run(turn)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.turns):
                res = runner.run(turn)
            per_turn = (time.perf_counter() - t0) / args.turns
            assert all(r[0].ok for r in res), res
            runner.close()
            print(f"{label:6s} calls/turn={calls:3d}  first turn {first * 1e3:8.1f} ms  turn {per_turn * 1e6:9.1f} us  "
                  f"per call {per_turn / calls * 1e6:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
