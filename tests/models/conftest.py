import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from hf_fixtures import make_hf_model  # noqa: E402

VOCAB = 1001  # deliberately not a multiple of 64


def make_tokenizer_dir(d: pathlib.Path, vocab: int = VOCAB) -> None:
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    make_tiny_hf_tokenizer(d, vocab_size=vocab)


@pytest.fixture(scope="session")
def hf_and_gguf(tmp_path_factory):
    """family -> (hf_dir, {type: gguf_path}), built lazily and cached for the session."""
    from strata.gguf.convert import convert

    root = tmp_path_factory.mktemp("models")
    cache: dict = {}

    def get(family: str, out_type: str = "f32"):
        hf = root / family / "hf"
        if family not in cache:
            make_hf_model(family, hf, vocab_size=VOCAB)
            make_tokenizer_dir(hf)
            cache[family] = {}
        if out_type not in cache[family]:
            out = root / family / f"model-{out_type}.gguf"
            convert(hf, out, out_type)
            cache[family][out_type] = out
        return hf, cache[family][out_type]

    return get
