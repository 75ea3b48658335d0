"""Tests for erpo_jax/data/iterator.py."""

import json
import itertools

import numpy as np
import pytest

from erpo_jax.data.iterator import LEGACY_ORDER, ORDER, QueryBatchIterator

N, B = 103, 8  # 12 full batches per epoch, 7 indices dropped each epoch


def _take(it, k):
    return [b.tolist() for b in itertools.islice(it, k)]


def test_same_seed_same_order_and_different_seeds_differ():
    a = _take(QueryBatchIterator(N, B, seed=5), 30)
    assert a == _take(QueryBatchIterator(N, B, seed=5), 30)
    assert a != _take(QueryBatchIterator(N, B, seed=6), 30)
    # Nearby seeds are not shifted copies of each other's epochs.
    assert _take(QueryBatchIterator(N, B, seed=6), 12) != a[12:24]


def test_epochs_are_permutations_and_reshuffle():
    it = QueryBatchIterator(N, B, seed=0)
    assert it.batches_per_epoch == N // B
    epochs = [np.concatenate(_take(it, it.batches_per_epoch)) for _ in range(3)]
    for e in epochs:
        assert len(e) == it.batches_per_epoch * B
        assert len(set(e.tolist())) == len(e)  # no repeats within an epoch
        assert e.min() >= 0 and e.max() < N
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert it.epoch == 3 and it.step == 3 * it.batches_per_epoch


def test_resume_yields_exactly_the_uninterrupted_batches():
    full = _take(QueryBatchIterator(N, B, seed=11), 40)
    it = QueryBatchIterator(N, B, seed=11)
    first = _take(it, 17)
    state = json.loads(json.dumps(it.get_state()))  # survives a JSON checkpoint
    resumed = QueryBatchIterator(N, B, seed=11)
    resumed.set_state(state)
    assert first + _take(resumed, 23) == full
    assert QueryBatchIterator(N, B, seed=11, step=17).batch_at(17).tolist() == full[17]
    with pytest.raises(ValueError, match="num_examples=103"):
        QueryBatchIterator(N + 1, B, seed=11).set_state(state)


def test_process_shards_are_disjoint_and_cover_the_global_batch():
    whole = QueryBatchIterator(N, B, seed=3)
    shards = [QueryBatchIterator(N, B, seed=3, process_index=p, process_count=2) for p in range(2)]
    for _ in range(25):
        g = next(whole)
        s0, s1 = next(shards[0]), next(shards[1])
        assert len(s0) == len(s1) == B // 2
        assert not set(s0.tolist()) & set(s1.tolist())
        assert np.concatenate([s0, s1]).tolist() == g.tolist()


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="not divisible by process_count 3"):
        QueryBatchIterator(N, B, seed=0, process_count=3)
    with pytest.raises(ValueError, match="at least"):
        QueryBatchIterator(4, B, seed=0)
    with pytest.raises(ValueError, match="process_index 2"):
        QueryBatchIterator(N, B, seed=0, process_index=2, process_count=2)


# Batches 0, 13 and 25 of QueryBatchIterator(103, 8, seed=11) as the iterator
# made them before it drew its own epoch permutations (commit b97bbd6, grain's
# index shuffle): a checkpoint saved then must resume in the same order.
GRAIN_ORDER_BATCHES = {0: [62, 99, 94, 87, 9, 50, 61, 16],
                       13: [64, 63, 65, 34, 37, 31, 81, 16],
                       25: [98, 1, 65, 77, 8, 88, 6, 0]}


def test_a_state_saved_before_the_order_field_resumes_in_grains_order():
    it = QueryBatchIterator(N, B, seed=11)
    assert it.get_state()["order"] == ORDER
    new = {s: it.batch_at(s).tolist() for s in GRAIN_ORDER_BATCHES}
    assert new != GRAIN_ORDER_BATCHES   # the default order is another one
    old_state = {"step": 13, "seed": 11, "num_examples": N, "global_batch_size": B}
    it.set_state(old_state)
    assert it.order == LEGACY_ORDER and it.get_state()["order"] == LEGACY_ORDER
    assert {s: it.batch_at(s).tolist() for s in GRAIN_ORDER_BATCHES} == GRAIN_ORDER_BATCHES
    assert next(it).tolist() == GRAIN_ORDER_BATCHES[13] and it.step == 14


def test_an_unknown_order_is_refused_by_name():
    state = {**QueryBatchIterator(N, B, seed=1).get_state(), "order": "fisher-yates-v9"}
    with pytest.raises(ValueError, match="order='fisher-yates-v9'"):
        QueryBatchIterator(N, B, seed=1).set_state(state)
