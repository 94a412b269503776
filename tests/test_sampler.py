"""DistributedPromptSampler: determinism, resume, rank partition, epochs."""
import itertools

import pytest

from spmdrl.data.sampler import DistributedPromptSampler
from spmdrl.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def make(rank=0, size=1, n=23, batch=8, seed=7, **kw):
    return DistributedPromptSampler(n, dp_rank=rank, dp_size=size, batch_size=batch, seed=seed, **kw)


def take(sampler, k):
    return list(itertools.islice(sampler, k))


def test_deterministic_for_seed():
    assert take(make(), 10) == take(make(), 10)
    assert take(make(), 10) != take(make(seed=8), 10)


def test_resume_mid_epoch_yields_identical_stream():
    ref = take(make(), 12)
    a = make()
    take(a, 1)  # mid-epoch: 23 prompts / 8 = 2 steps per epoch
    state = a.state_dict()
    assert state == {"epoch": 0, "step_in_epoch": 1, "seed": 7}
    b = make(seed=123)  # the saved seed wins
    b.load_state_dict(state)
    assert take(b, 11) == ref[1:]
    assert take(a, 11) == ref[1:]


def test_resume_across_epochs():
    ref = take(make(n=40, batch=8), 13)
    a = make(n=40, batch=8)
    take(a, 7)
    assert a.state_dict()["epoch"] == 1 and a.state_dict()["step_in_epoch"] == 2
    b = make(n=40, batch=8)
    b.load_state_dict(a.state_dict())
    assert take(b, 6) == ref[7:]


def test_ranks_partition_global_batch():
    size = 4
    samplers = [make(rank=r, size=size, n=50, batch=12) for r in range(size)]
    ref = make(n=50, batch=12)
    for _ in range(9):  # crosses epoch boundaries (4 steps per epoch)
        expected = ref.global_batch()
        next(ref)
        slices = [next(s) for s in samplers]
        assert all(len(s) == 3 for s in slices)
        assert sum(slices, []) == expected
        assert len(set(expected)) == 12


def test_epochs_differ_and_cover_without_repeats():
    s = make(n=24, batch=8)
    assert s.steps_per_epoch == 3
    e0, e1 = sum(take(s, 3), []), sum(take(s, 3), [])
    assert sorted(e0) == sorted(e1) == list(range(24))
    assert e0 != e1
    assert s.state_dict()["epoch"] == 2


def test_drop_last_false_fills_last_batch():
    ranks = [make(n=20, batch=8, drop_last=False, rank=r, size=2) for r in range(2)]
    assert ranks[0].steps_per_epoch == 3
    batches = [b for s in ranks for b in take(s, 3)]
    assert all(len(b) == 4 for b in batches)
    assert set(sum(batches, [])) == set(range(20))
    assert ranks[0].state_dict()["epoch"] == 1


def test_no_shuffle_is_in_order():
    s = make(n=10, batch=4, shuffle=False)
    assert take(s, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_config_errors():
    with pytest.raises(ConfigError) as e:
        make(size=3, batch=8)
    assert "multiple of 3" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        make(rank=2, size=2)
    with pytest.raises(ConfigError):
        make(n=5, batch=8)


def test_bad_state():
    s = make()
    with pytest.raises(CheckpointError):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(CheckpointError):
        s.load_state_dict({"epoch": 0, "step_in_epoch": 9, "seed": 7})
