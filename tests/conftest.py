import os
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


@pytest.fixture
def llamacpp_models():
    if not LLAMACPP_MODELS.is_dir():
        pytest.skip(f"test data not found at {LLAMACPP_MODELS}")
    return LLAMACPP_MODELS
