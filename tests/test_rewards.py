"""spmdrl.rewards: built-in scorers, dispatch, user functions, batch scoring errors."""
import math
import textwrap

import pytest
import torch

from spmdrl.errors import RewardError
from spmdrl.rewards import REWARD_FNS, compute_rewards, default_compute_score, load_reward_fn
from spmdrl.rewards.arith import arith_reward
from spmdrl.rewards.gsm8k import compute_score, extract_solution

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


# ----- GSM8K -----

def test_gsm8k_extract():
    text = "First 3 apples, then 1,000 more.\n#### 1,003"
    assert extract_solution(text, "strict") == "1003"
    assert extract_solution("#### 5 then #### -12", "strict") == "-12"
    assert extract_solution("the answer is 42", "strict") is None
    assert extract_solution("the answer is 42.", "flexible") == "42"
    assert extract_solution("3 then 4.5 and finally 7,000", "flexible") == "7000"
    assert extract_solution("no numbers", "flexible") is None


def test_gsm8k_score():
    assert compute_score("so #### 72", "72") == 1.0
    assert compute_score("so #### 71", "72") == 0.0
    assert compute_score("so #### 71", "72", format_score=0.1) == 0.1
    assert compute_score("it is 72", "72", format_score=0.1) == 0.0
    assert compute_score("it is 72", "72", method="flexible") == 1.0
    assert compute_score("#### 2,400", "2400") == 1.0
    assert compute_score("#### 72.0", "72") == 1.0


def test_arith():
    assert arith_reward(" 46\n", "46") == 1.0
    assert arith_reward("045", "45") == 1.0
    assert arith_reward("47", "46") == 0.0
    assert arith_reward("46 apples", "46") == 0.0
    assert arith_reward("", "46") == 0.0
    assert arith_reward("4_6", "46") == 0.0
    assert arith_reward("-3", "-3") == 1.0


# ----- dispatch -----

def test_registry_and_dispatch():
    assert {"openai/gsm8k", "gsm8k", "synthetic/arith"} <= set(REWARD_FNS.names())
    assert default_compute_score("openai/gsm8k", "#### 3", "3", {}) == 1.0
    assert default_compute_score("gsm8k", "#### 4", "3", None) == 0.0
    assert default_compute_score("synthetic/arith", "46", "46", {"a": 1}) == 1.0


def test_unknown_data_source():
    with pytest.raises(RewardError) as e:
        default_compute_score("my/task", "x", "y", {})
    one_line(e, "'my/task'", "openai/gsm8k", "synthetic/arith", "reward.custom_fn")


# ----- user functions -----

@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        import dataclasses

        @dataclasses.dataclass
        class Cfg:
            bonus: float = 0.5

        NOT_A_FN = 3

        def score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)

        def with_extras(data_source, solution_str, ground_truth, extra_info=None):
            out = {"score": 1.0 if solution_str == ground_truth else -1.0, "acc": solution_str == ground_truth}
            if extra_info and extra_info.get("tag"):
                out["tag"] = extra_info["tag"]
            return out

        def boom(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "bad":
                raise ValueError("cannot parse\\nmulti-line")
            return 0.0
    """))
    return str(path)


def test_load_from_file(user_file):
    fn = load_reward_fn(f"{user_file}:score")
    assert fn(data_source="x", solution_str="a", ground_truth="a") == 1.0
    assert load_reward_fn(f"{user_file}:score") is fn  # loaded once


def test_load_from_module():
    assert load_reward_fn("spmdrl.rewards.registry:default_compute_score") is default_compute_score


@pytest.mark.parametrize("spec_fmt,needles", [
    ("{dir}/missing.py:score", ["missing.py", "not found"]),
    ("{file}:nope", ["'nope'", "callables there", "score"]),
    ("{file}:NOT_A_FN", ["'NOT_A_FN'", "not callable"]),
    ("{file}", ["expected"]),
    ("no_such_pkg_xyz.mod:fn", ["'no_such_pkg_xyz.mod'", "not found"]),
    ("spmdrl.rewards.gsm8k:missing_fn", ["'missing_fn'"]),
])
def test_load_errors(user_file, tmp_path, spec_fmt, needles):
    spec = spec_fmt.format(dir=tmp_path, file=user_file)
    with pytest.raises(RewardError) as e:
        load_reward_fn(spec)
    one_line(e, repr(spec), *needles)


def test_load_file_that_raises_on_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('bad\\nimport')\n")
    with pytest.raises(RewardError) as e:
        load_reward_fn(f"{path}:fn")
    one_line(e, "broken.py:fn", "RuntimeError", "bad import")


# ----- compute_rewards -----

def test_compute_rewards_builtin():
    scores, extras = compute_rewards(
        default_compute_score,
        ["synthetic/arith", "openai/gsm8k", "synthetic/arith"],
        ["46", "#### 9", "nope"],
        ["46", "9", "3"],
        [{}, {}, {}],
    )
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 1.0, 0.0]
    assert extras == {}


def test_compute_rewards_dict_extras(user_file):
    fn = load_reward_fn(f"{user_file}:with_extras")
    scores, extras = compute_rewards(fn, ["x", "x"], ["a", "b"], ["a", "a"], [{"tag": "t"}, None])
    assert scores.tolist() == [1.0, -1.0]
    assert extras == {"acc": [True, False], "tag": ["t", None]}


def test_compute_rewards_user_fn_raises(user_file):
    fn = load_reward_fn(f"{user_file}:boom")
    with pytest.raises(RewardError) as e:
        compute_rewards(fn, ["x", "x", "x"], ["ok", "ok", "bad"], ["1", "1", "1"], [{}, {}, {}])
    one_line(e, f"{user_file}:boom", "sample 2", "ValueError", "cannot parse multi-line")
    assert isinstance(e.value.__cause__, ValueError)


def test_compute_rewards_names_plain_function():
    def local_fn(data_source, solution_str, ground_truth, extra_info):
        raise KeyError("k")

    with pytest.raises(RewardError) as e:
        compute_rewards(local_fn, ["x"], ["s"], ["g"], [{}])
    one_line(e, f"{__name__}:", "local_fn", "sample 0", "KeyError")


def test_compute_rewards_unknown_source_is_reward_error():
    with pytest.raises(RewardError) as e:
        compute_rewards(default_compute_score, ["synthetic/arith", "other"], ["1", "1"], ["1", "1"], [{}, {}])
    one_line(e, "sample 1", "'other'", "reward.custom_fn")


@pytest.mark.parametrize("ret,needle", [(None, "NoneType"), ("1.0", "str"), ({"acc": 1}, "without 'score'"),
                                        (math.nan, "nan")])
def test_compute_rewards_bad_returns(ret, needle):
    def fn(data_source, solution_str, ground_truth, extra_info):
        return ret

    with pytest.raises(RewardError) as e:
        compute_rewards(fn, ["x"], ["s"], ["g"], [{}])
    one_line(e, "fn", "sample 0", needle)


def test_compute_rewards_accepts_numeric_kinds():
    vals = iter([1, True, torch.tensor(0.5), {"score": 2}])

    def fn(data_source, solution_str, ground_truth, extra_info):
        return next(vals)

    scores, _ = compute_rewards(fn, ["x"] * 4, ["s"] * 4, ["g"] * 4, None)
    assert scores.tolist() == [1.0, 1.0, 0.5, 2.0]


def test_a_reward_file_imports_its_sibling_modules(tmp_path):
    """`import helpers` in my_reward.py finds helpers.py beside it, in the ranks' safe-path mode too (the
    launch directory is not on sys.path there)."""
    from spmdrl.rewards.custom import compute_rewards, load_reward_fn

    (tmp_path / "sibling_helpers_4f2.py").write_text("def normalise(s):\n    return s.strip().lower()\n")
    (tmp_path / "my_reward.py").write_text(
        "import sibling_helpers_4f2 as h\n\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(h.normalise(solution_str) == h.normalise(ground_truth)), 'len': len(solution_str)}\n"
    )
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:score")
    scores, extras = compute_rewards(fn, ["x", "x"], [" A ", "b"], ["a", "a"])
    assert scores.tolist() == [1.0, 0.0] and extras == {"len": [3, 1]}
