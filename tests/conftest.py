import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# helper modules imported by name from any test folder (never `from conftest import`: which conftest that
# finds depends on collection order)
sys.path.insert(0, str(ROOT / "tests" / "models"))  # hf_fixtures, gguf_rewrite
sys.path.insert(0, str(ROOT / "tests" / "quant"))  # quant_helpers
# Real data nobody here wrote (vocabularies, chat templates from llama.cpp, MIT; see its README).
# (kept in the repository so a clean clone tests against it)
TESTDATA = pathlib.Path(os.environ.get("STRATA_TESTDATA", ROOT / "tests" / "data"))
LLAMACPP_MODELS = TESTDATA / "llama.cpp-models"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked exact_cpu (or in a module so marked) runs CPU qmatmul as the float32 reference, its fixtures'
    setup included: its oracle is float math on dequantized weights, not int8-rounded activations."""
    from strata.quant import matmul

    matmul.CPU_EXACT = item.get_closest_marker("exact_cpu") is not None


@pytest.fixture
def llamacpp_models():
    if not LLAMACPP_MODELS.is_dir():
        pytest.skip(f"test data not found at {LLAMACPP_MODELS}")
    return LLAMACPP_MODELS


VOCAB = 1001  # deliberately not a multiple of 64


@pytest.fixture(scope="session")
def hf_and_gguf(tmp_path_factory):
    """family -> (hf_dir, {type: gguf_path}), built lazily and cached for the session."""
    from strata.gguf.convert import convert

    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def get(family: str, out_type: str = "f32"):
        hf = root / family / "hf"
        if family not in cache:
            from hf_fixtures import make_hf_model, make_tokenizer_dir

            make_hf_model(family, hf, vocab_size=VOCAB)
            make_tokenizer_dir(hf, VOCAB)
            cache[family] = {}
        if out_type not in cache[family]:
            out = root / family / f"model-{out_type}.gguf"
            convert(hf, out, out_type)
            cache[family][out_type] = out
        return hf, cache[family][out_type]

    return get
