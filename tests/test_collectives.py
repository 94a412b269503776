"""Metric reduction over real gloo ranks, against means computed by hand."""
import json
import os

from launching import run

HERE = os.path.dirname(os.path.abspath(__file__))


def test_reduce_mean_fused_and_rare_paths(tmp_path):
    out = tmp_path / "out.json"
    run([os.path.join(HERE, "dist_scripts", "collectives_check.py"), str(out)], nproc=2)
    res = json.load(open(out))
    assert res["same"] == {"a": 1.5, "b": 15.0}
    assert res["weighted"] == {"a": (1.0 * 1 + 2.0 * 3) / 4}
    assert res["different"] == {"a": 2.5, "only1": 5.0}  # averaged over the ranks that have the key
    assert res["empty_vs_one"] == {"x": 4.0}
