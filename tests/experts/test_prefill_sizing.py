"""A prompt chunk's VRAM per token: a hybrid model's delta-net layers count (their chunked form outgrows the
attention temporaries the plain rule was measured with), alike in `strata check` and the engine."""

from strata.config import EngineConfig
from strata.engine.loader import load_model
from strata.experts.sizing import (PREFILL_TARGET, deltanet_prefill_bytes, model_prefill_bytes, prefill_bytes_for,
                                   prefill_bytes_per_token)
from strata.hub.check import model_footprint


def test_attention_models_keep_the_measured_rule():
    assert prefill_bytes_for(2048, 8) == prefill_bytes_per_token(2048, 8) == 2048 * 116


def test_qwen3_next_shapes_need_their_delta_net_chunk():
    # Qwen3-Next-80B-A3B: hidden 2048, top-10, 16 key / 32 value heads of 128
    mixer = deltanet_prefill_bytes(16, 32, 128, 128)
    assert mixer == 4 * (17 * 32 * 128 + 3 * 8192)
    plain = prefill_bytes_per_token(2048, 10)
    hybrid = prefill_bytes_for(2048, 10, mixer)
    assert hybrid == 2048 * 60 + mixer > plain
    # the 4K chunk that ran out of a 1.02 GiB share on the GPU machine now sizes ~1.9 GiB
    assert 1.8 < PREFILL_TARGET * hybrid / 2**30 < 2.0


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
