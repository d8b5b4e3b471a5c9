"""A KV cache larger than the memory: one error naming the numbers and the context that fits, before anything is
allocated on a CPU (zeroing more than the RAM got the process killed) and when the allocator itself refuses."""

import subprocess
import sys

import pytest
import torch

from strata import StrataError
from strata.kv import cache
from strata.kv.cache import KVCache

SHAPE = (2, 64)  # two KV heads of 64 values: 512 bytes a token a layer in f32


def test_a_cache_larger_than_the_ram_is_refused_with_the_numbers():
    per = KVCache.bytes_per_token(1, SHAPE, SHAPE, torch.float32)
    avail = cache.ram_available()
    ctx = avail // per * 4  # four times the free RAM
    with pytest.raises(StrataError, match=rf"KV cache of 1 slot\(s\) x {ctx} tokens needs .* GiB of RAM, .* GiB "
                       r"is free: -c \d+ fits"):
        KVCache(1, 1, ctx, SHAPE, SHAPE, torch.float32, "cpu")
    with pytest.raises(StrataError, match=r"KV cache of 2 slot\(s\)"):
        KVCache(1, 2, ctx, SHAPE, SHAPE, torch.float32, "cpu", "q8_0", "q4_0")
    KVCache(1, 1, 1024, SHAPE, SHAPE, torch.float32, "cpu")  # (a cache that fits is made as before)


def test_too_many_slots_names_the_slot_count_that_fits():
    """`-np` past what the memory holds at this -c: the error offers fewer slots as well as a shorter context."""
    per = KVCache.bytes_per_token(1, SHAPE, SHAPE, torch.float32)
    avail = cache.ram_available()
    ctx = avail // per // 8  # an eighth of the free RAM a slot: 8 slots fit, 64 do not
    with pytest.raises(StrataError, match=rf"64 slot\(s\) x {ctx} tokens needs .*: -c \d+ fits, or -np \d at this -c"):
        KVCache(1, 64, ctx, SHAPE, SHAPE, torch.float32, "cpu")


def test_an_allocation_the_allocator_refuses_is_the_same_error(monkeypatch):
    """Where the free memory is not known (a GPU; no psutil), the allocator's own failure becomes the error."""
    monkeypatch.setattr(cache, "ram_available", lambda: None)
    with pytest.raises(StrataError, match=r"x 1000000000000 tokens needs .* GiB of RAM: use a smaller -c"):
        KVCache(1, 1, 10**12, SHAPE, SHAPE, torch.float32, "cpu")


def test_a_huge_context_on_the_command_line_is_one_line():
    r = subprocess.run([sys.executable, "-m", "strata", "generate", "--device", "cpu", "-c", str(10**12), "-p", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "strata: error: the KV cache of 1 slot(s) x 1000000000000 tokens needs" in r.stderr, r.stderr
