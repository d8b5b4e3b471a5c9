"""A prompt chunk's VRAM per token: a hybrid model's delta-net layers count (their chunked form outgrows the
attention temporaries the plain rule was measured with), alike in `strata check` and the engine."""

import pytest
import torch

from strata.config import EngineConfig
from strata.experts import sizing
from strata.engine.loader import load_model
from strata.experts.sizing import (PREFILL_TARGET, deltanet_prefill_bytes, model_prefill_bytes, prefill_bytes_for,
                                   prefill_bytes_per_token)
from strata.hub.check import model_footprint


def test_attention_models_keep_the_measured_rule():
    assert prefill_bytes_for(2048, 8) == prefill_bytes_per_token(2048, 8) == 2048 * 116


def test_qwen3_next_shapes_need_their_delta_net_chunk():
    # Qwen3-Next-80B-A3B: hidden 2048, top-10, 16 key / 32 value heads of 128
    mixer = deltanet_prefill_bytes(16, 32, 128, 128)
    assert mixer == 4 * (2 * 8192 + 4096 + 4 * 4096 + 8 * 64 * 32 * (11 * 128 + 128) // 2048) == 196608
    plain = prefill_bytes_per_token(2048, 10)
    hybrid = prefill_bytes_for(2048, 10, mixer)
    assert hybrid == 2048 * 60 + mixer > plain
    # the 4K chunk that ran out of a 1.02 GiB share on the GPU machine (before the delta rule's chunks were
    # grouped and the conv's windows summed in place) now sizes 1.22 GiB
    assert 1.2 < PREFILL_TARGET * hybrid / 2**30 < 1.25


def test_the_sizing_knows_the_delta_rules_chunks():
    from strata.layers import deltanet

    assert (sizing.DELTANET_CHUNK, sizing.DELTANET_GROUP) == (deltanet.CHUNK, deltanet.GROUP)


def _peak_bytes(fn) -> int:
    """The most bytes of tensors alive at once while fn runs (each op's outputs counted until freed)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Peak(TorchDispatchMode):
        live = peak = 0
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                    if key not in self.seen:
                        self.seen.add(key)
                        self.live += n
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(t, self._free, key, n)
            return out

        def _free(self, key, n):
            self.seen.discard(key)
            self.live -= n

    with Peak() as p:
        fn()
    return p.peak


@pytest.mark.parametrize("tokens", [2048, 4096])
def test_a_delta_net_layers_prompt_chunk_stays_within_its_share(tokens):
    """The delta rule and its conv over a prompt chunk of Qwen3-Next's shapes, every tensor tracked: within the
    share the sizing gives (the projections' float32 output counted as the layer's input here)."""
    import torch.nn.functional as F

    from strata.layers.deltanet import causal_conv, delta_chunked, l2norm

    hk, hv, dk, dv, K = 16, 32, 128, 128, 4
    conv = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(0)
    qkv, ba = torch.randn(tokens, conv, generator=g), torch.randn(tokens, 2 * hv, generator=g)

    def layer():
        mixed, _ = causal_conv(qkv, torch.zeros(K - 1, conv), torch.randn(conv, K, generator=g))
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)

        def per_value_head(x):
            return l2norm(x.reshape(tokens, hk, dk)).unsqueeze(2).expand(tokens, hk, 2, dk).reshape(tokens, hv, dk)

        delta_chunked(per_value_head(q), per_value_head(k), v.reshape(tokens, hv, dv), -F.softplus(ba[:, :hv]),
                      ba[:, hv:].sigmoid(), torch.zeros(hv, dk, dv))

    inputs = 4 * (conv + hv * dv + 2 * hv) * tokens  # the projections' output, as the layer holds it
    peak = _peak_bytes(layer) + inputs
    share = deltanet_prefill_bytes(hk, hv, dk, dv) * tokens
    assert peak <= share, (peak / tokens / 1024, share / tokens / 1024)
    assert peak > 0.7 * share  # (and not far over what it takes)


def test_check_and_the_engine_count_a_hybrid_model_alike(hf_and_gguf):
    _, path = hf_and_gguf("qwen3next")
    fp = model_footprint([path])
    lm = load_model(str(path), EngineConfig(device="cpu", dtype="float32"))
    lin = lm.args.extra["linear"]
    assert fp.mixer_prefill_bytes == deltanet_prefill_bytes(lin["hk"], lin["hv"], lin["dk"], lin["dv"]) > 0
    assert model_prefill_bytes(lm.args) == prefill_bytes_for(fp.d_model, fp.n_expert_used, fp.mixer_prefill_bytes)

    _, plain_path = hf_and_gguf("qwen3moe")
    plain = load_model(str(plain_path), EngineConfig(device="cpu", dtype="float32"))
    assert model_footprint([plain_path]).mixer_prefill_bytes == 0
    assert model_prefill_bytes(plain.args) == prefill_bytes_per_token(plain.args.d_model, plain.args.n_experts_used)
