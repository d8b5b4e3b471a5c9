"""The per-slot recurrent state store: snapshots restore in place, `keep` takes a verify segment back to the
state after its first n tokens, and the hybrid cache counts the state in its size."""

import torch

from strata.kv.recurrent import HybridCache, RecurrentState


def _store(n_slots=3):
    st = RecurrentState([0, 2], n_slots, (3, 8), (2, 4, 5), device="cpu")
    g = torch.Generator().manual_seed(0)
    for d in (st.conv, st.ssm):
        for t in d.values():
            t.copy_(torch.randn(t.shape, generator=g))
    return st


def test_snapshot_restores_the_chosen_slots_in_place():
    st = _store()
    before = {i: (st.conv[i].clone(), st.ssm[i].clone()) for i in st.layers}
    buffers = [st.conv[0].data_ptr(), st.ssm[2].data_ptr()]
    snap = st.snapshot([2, 0])
    for i in st.layers:
        st.conv[i].add_(1.0)
        st.ssm[i].mul_(3.0)
    st.restore(snap)
    for i in st.layers:
        for got, want in zip((st.conv[i], st.ssm[i]), before[i]):
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
            assert not torch.equal(got[1], want[1])  # not in the snapshot: left as it is
    assert [st.conv[0].data_ptr(), st.ssm[2].data_ptr()] == buffers


def test_host_snapshot_takes_no_device_copy_and_restores():
    """A host snapshot (the engine's before a prompt chunk, while the VRAM lent to the expert cache is not yet
    borrowed back) reads each slot through a view: a gather by index would first take its size on the device."""
    from torch.overrides import TorchFunctionMode

    class Gathers(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and isinstance(args[1], (list, torch.Tensor)):
                self.n += 1
            return func(*args, **(kwargs or {}))

    st = _store()
    before = {i: (st.conv[i].clone(), st.ssm[i].clone()) for i in st.layers}
    with Gathers() as g:
        snap = st.snapshot([2, 0], host=True)
    assert g.n == 0
    assert all(t.device.type == "cpu" and t.shape[0] == 2 for d in ("conv", "ssm") for t in snap[d].values())
    for i in st.layers:
        st.conv[i].zero_()
        st.ssm[i].zero_()
    st.restore(snap)
    for i in st.layers:
        for got, want in zip((st.conv[i], st.ssm[i]), before[i]):
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_keep_takes_the_state_after_n_tokens():
    st = _store()
    n_tok = 4
    for i in st.layers:
        states = torch.arange(n_tok, dtype=torch.float32).view(n_tok, 1, 1, 1).expand(n_tok, 2, 4, 5).clone()
        inputs = torch.arange(3 + n_tok, dtype=torch.float32).view(-1, 1).expand(3 + n_tok, 8).clone()
        st.pending[(i, 1)] = (states, inputs)
    st.keep(1, 2)
    for i in st.layers:
        assert torch.equal(st.ssm[i][1], torch.full((2, 4, 5), 1.0))  # the state after token 1 (0-based)
        assert st.conv[i][1][:, 0].tolist() == [2.0, 3.0, 4.0]  # the last 3 inputs up to that token
    assert not st.pending


def test_hybrid_cache_counts_the_state():
    st = RecurrentState([0, 2], 2, (3, 8), (2, 4, 5), device="cpu")
    kv = HybridCache(1, 2, 16, (2, 6), (2, 6), torch.float32, "cpu", st)
    assert st.nbytes == 2 * RecurrentState.bytes_per_slot(2, (3, 8), (2, 4, 5)) == 2 * 2 * (24 + 40) * 4
    assert kv.nbytes == 2 * 2 * 16 * 12 * 4 + st.nbytes
    assert kv.recurrent is st
