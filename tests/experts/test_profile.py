"""Routing profiles: gathering, ranking, atomic files, warming a cache policy."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import strata
from strata import StrataError
from strata.experts.policy import DecayedCountPolicy, LRUPolicy
from strata.experts.profile import RoutingProfile, atomic_write_text, warm_policy


def make_profile(seed=0, n_layers=4, n_experts=16, fractional=False):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(n_layers, n_experts)).astype(float)
    if fractional:
        counts += rng.random((n_layers, n_experts))
    return RoutingProfile(n_layers, n_experts, counts, tokens=100, model="tiny-moe")


def test_observe_rank_frequency():
    prof = RoutingProfile(2, 6)
    assert prof.frequency(0).tolist() == [0.0] * 6
    for ids in ([3, 1], [3, 5], [3, 1]):
        prof.observe(0, ids)
        prof.observe(1, [0, 0])  # a batch may route one expert twice
        prof.add_tokens()
    assert prof.ranking(0) == [3, 1, 5, 0, 2, 4]  # ties by id
    assert prof.frequency(0)[3] == 1.0 and prof.frequency(1)[0] == 2.0
    assert prof.rankings()[1][0] == 0
    with pytest.raises(ValueError):
        prof.observe(0, [6])
    with pytest.raises(ValueError):
        prof.observe(0, [-1])


def test_round_trip(tmp_path):
    prof = make_profile(fractional=True)
    path = tmp_path / "profiles" / "routing.json"
    prof.save(path)
    back = RoutingProfile.load(path, n_layers=4, n_experts=16)
    assert back == prof
    np.testing.assert_array_equal(back.counts, prof.counts)
    assert back.ranking(2) == prof.ranking(2) and back.model == "tiny-moe"
    ints = make_profile(seed=1)
    ints.save(path)  # overwrites
    assert RoutingProfile.load(path) == ints
    assert json.loads(path.read_text())["counts"][0][0] == int(ints.counts[0, 0])
    assert sorted(p.name for p in path.parent.iterdir()) == ["routing.json"]


def test_mismatch_and_bad_files(tmp_path):
    path = tmp_path / "routing.json"
    make_profile().save(path)
    with pytest.raises(StrataError, match="has 4 layers x 16 experts, the model has 48 x 16"):
        RoutingProfile.load(path, n_layers=48, n_experts=16)
    with pytest.raises(StrataError, match="has 4 layers x 16 experts, the model has 4 x 128"):
        RoutingProfile.load(path, n_experts=128)
    with pytest.raises(StrataError, match="not found"):
        RoutingProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "strata-routing-profile"')
    with pytest.raises(StrataError, match="unreadable"):
        RoutingProfile.load(bad)
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(StrataError, match="not a strata routing profile"):
        RoutingProfile.load(bad)
    data = make_profile().to_dict()
    data["counts"] = data["counts"][:3]
    bad.write_text(json.dumps(data))
    with pytest.raises(StrataError, match="malformed.*shape"):
        RoutingProfile.load(bad)
    data = make_profile().to_dict()
    data["counts"][0][0] = -1
    bad.write_text(json.dumps(data))
    with pytest.raises(StrataError, match="malformed.*>= 0"):
        RoutingProfile.load(bad)
    data["version"] = 99
    bad.write_text(json.dumps(data))
    with pytest.raises(StrataError, match="version 99"):
        RoutingProfile.load(bad)


# The child writes a large profile under a file-size limit, so the write fails part-way for real
# (EFBIG), as on a full disk.
_FAILING_SAVE = """
import resource, signal, sys
import numpy as np
from strata.experts.profile import RoutingProfile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
prof = RoutingProfile(48, 128, np.random.default_rng(0).random((48, 128)) * 1000, tokens=5)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
try:
    prof.save(sys.argv[1])
except OSError as e:
    print("failed:", e)
    sys.exit(3)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs RLIMIT_FSIZE")
def test_failed_save_leaves_old_file_intact(tmp_path):
    path = tmp_path / "routing.json"
    old = make_profile()
    old.save(path)
    before = path.read_bytes()
    root = str(pathlib.Path(strata.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _FAILING_SAVE, str(path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "failed" in proc.stdout
    assert path.read_bytes() == before
    assert RoutingProfile.load(path) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.json"]  # the partial temp is gone


def test_atomic_write_text_error_keeps_old(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "new \udcff")  # a lone surrogate fails mid-write in utf-8
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_merge_and_from_policy():
    a, b = make_profile(0), make_profile(1)
    m = a.merge(b)
    np.testing.assert_array_equal(m.counts, a.counts + b.counts)
    assert m.tokens == 200
    with pytest.raises(StrataError, match="the profile being merged has 4 x 8"):
        a.merge(RoutingProfile(4, 8))

    policy = LRUPolicy(2, 8, 2)
    for ids in ([1, 2], [2, 3], [2, 7]):
        policy.tick()
        policy.observe(0, ids)
        policy.observe(1, [5])
    prof = RoutingProfile.from_policy(policy, model="m")
    assert prof.tokens == 3 and prof.counts[0].tolist() == [0, 1, 3, 1, 0, 0, 0, 1]
    assert prof.ranking(0)[:2] == [2, 1] and prof.ranking(1)[0] == 5


def test_warm_policy_from_profile(tmp_path):
    prof = RoutingProfile(2, 8)
    for _ in range(10):
        prof.observe(0, [6, 2])
        prof.observe(1, [1, 4])
        prof.add_tokens()
    prof.observe(0, [3])
    prof.save(tmp_path / "p.json")
    policy = DecayedCountPolicy(2, 8, 3)
    warm_policy(policy, RoutingProfile.load(tmp_path / "p.json", n_layers=2, n_experts=8))
    assert set(policy.resident(0)) == {6, 2, 3} and policy.is_hit(1, 4)
    assert policy.scores(0)[6] == pytest.approx(1.0 / (1 - policy.decay))
    with pytest.raises(StrataError, match="the cache policy has 2 x 16"):
        warm_policy(DecayedCountPolicy(2, 16, 3), prof)


def test_layer_slots_follow_the_profile_within_the_budget():
    from itertools import product

    from strata.experts.profile import layer_slots

    # layer 0 routes to 2 experts, layer 1 spreads over 4, layer 2 was never seen (uniform)
    counts = np.array([[90, 10, 0, 0], [25, 25, 25, 25], [0, 0, 0, 0]], dtype=float)
    # shares 0.9 > 0.25 (layers 1 and 2, ties in layer order) > 0.1: the second expert of layer 0 comes last
    assert layer_slots(counts, 6 * 100, [100, 100, 100]) == [1, 4, 1]
    assert layer_slots(counts, 9 * 100, [100, 100, 100]) == [1, 4, 4]
    assert layer_slots(counts, 10 * 100, [100, 100, 100]) == [2, 4, 4]
    assert sum(layer_slots(counts, 5 * 100, [100, 100, 100])) == 5
    assert layer_slots(counts, 10**9, [100, 100, 100]) == [4, 4, 4]  # never past the experts
    assert layer_slots(counts, 0, [100, 100, 100]) == [0, 0, 0]
    # bytes differ per layer: a cheap layer's experts come first at equal shares
    assert layer_slots(np.ones((2, 3)), 300, [100, 200]) == [3, 0]

    # optimal: no other layout of at most the budget covers more routing (brute force, equal sizes)
    rng = np.random.default_rng(0)
    c = rng.integers(0, 20, size=(3, 4)).astype(float)
    share = c / c.sum(1, keepdims=True)
    best = max(sum(np.sort(share[i])[::-1][:k].sum() for i, k in enumerate(ks))
               for ks in product(range(5), repeat=3) if sum(ks) <= 6)
    got = layer_slots(c, 600, [100, 100, 100])
    assert sum(got) <= 6
    assert sum(np.sort(share[i])[::-1][:k].sum() for i, k in enumerate(got)) == pytest.approx(best)
    with pytest.raises(ValueError):
        layer_slots(c, 100, [100, 100])
