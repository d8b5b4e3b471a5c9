"""Helpers for the llama.cpp oracle: tiny checkpoints -> GGUF, GGUF rewriting, running llama.cpp in a child."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

WORKER = Path(__file__).with_name("llamacpp_worker.py")
VOCAB = 512


def hf_fixtures():
    """tests/models/hf_fixtures.py (tests/ is not a package, so import it from its directory)."""
    d = str(Path(__file__).resolve().parents[1] / "models")
    if d not in sys.path:
        sys.path.insert(0, d)
    import hf_fixtures

    return hf_fixtures


def make_checkpoint(family: str, out: Path, tok_dir: Path, seed: int = 0, std: float = 0.08,
                    logit_std: float = 3.0, **overrides) -> Path:
    """A tiny random checkpoint of `family` (tests/models/hf_fixtures.py's config, `overrides` applied), with the
    tokenizer files of tok_dir.

The output head is scaled so that the logits have std ~logit_std: the final RMSNorm makes the hidden state's
    RMS ~1, so plain std-0.08 weights give logits of std 0.08 * sqrt(d_model) (0.64 at d_model 64), and many
    greedy steps would then be decided by margins of a few 1e-3 and quantized comparisons by noise. Std 3 gives
    top-1/top-2 margins of ~0.1-1 while staying far from one-hot. For tied embeddings (qwen3) the input
    embedding is scaled with it, which the first RMSNorm absorbs.
    """
    import transformers

    fx = hf_fixtures()
    spec = fx.FAMILIES[family]
    if not overrides:
        model = fx.make_hf_model(family, out, VOCAB, seed=seed, std=std)
    else:
        # same initialisation as make_hf_model, on a modified config (row lengths for K-quants, layer counts)
        torch.manual_seed(seed)
        cfg = getattr(transformers, spec["cfg"])(vocab_size=VOCAB, **{**spec["kw"], **overrides})
        model = getattr(transformers, spec["cls"])(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1 and "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif "e_score_correction_bias" in name:
                    p.copy_(0.05 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)
            for name, b in model.named_buffers():
                if "e_score_correction_bias" in name:
                    b.copy_(0.05 * torch.randn_like(b))
    with torch.no_grad():
        head = model.get_output_embeddings().weight  # [V, d_model]
        head.mul_(logit_std / (std * head.shape[1] ** 0.5))
    model.save_pretrained(out)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


def rewrite_gguf(src: Path, dst: Path, kv: dict | None = None, tensors: dict | None = None) -> Path:
    """Copy a GGUF file, replacing metadata values (`kv`: key -> value, same type) and tensors
    (`tensors`: name -> (numpy raw data as gguf-py's writer takes it, GGMLQuantizationType))."""
    import gguf

    kv, tensors = kv or {}, tensors or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue  # written by the writer itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, kv.get(f.name, f.contents()), vtype, sub_type=sub)
    for t in r.tensors:
        data, qtype = tensors.get(t.name, (t.data, t.tensor_type))
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.asarray(data))
        else:
            w.add_tensor(t.name, np.asarray(data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def gguf_value(path: Path, key: str):
    import gguf

    f = gguf.GGUFReader(path).fields.get(key)
    return None if f is None else f.contents()


class LlamaCppError(RuntimeError):
    pass


def run_llamacpp(model: Path, requests: list[dict], force_token: int, workdir: Path, threads: int = 2) -> list[dict]:
    """Run the requests (see llamacpp_worker.py) on `model` in a child process; llama.cpp's log tail on failure."""
    job, res = workdir / f"{model.stem}.job.json", workdir / f"{model.stem}.res.json"
    job.write_text(json.dumps({"model": str(model), "threads": threads, "ctx": 256, "force_token": force_token,
                               "requests": requests}))
    res.unlink(missing_ok=True)
    # OpenMP threads that spin while idle starve the server's HTTP thread on a 2-core machine (measured:
    # 1-180 ms per one-token request instead of ~1 ms); passive waiting keeps each request fast.
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    cp = subprocess.run([sys.executable, str(WORKER), str(job), str(res)], capture_output=True, text=True,
                        env=env, timeout=300)
    if cp.returncode != 0 or not res.exists():
        lines = [ln for ln in cp.stderr.splitlines() if " E " in ln or "error" in ln.lower() or "ASSERT" in ln]
        raise LlamaCppError(f"llama.cpp failed on {model.name} (exit {cp.returncode}): "
                            + " | ".join(lines[-6:] or cp.stderr.splitlines()[-6:]))
    return json.loads(res.read_text())["results"]


def _round_like_llamacpp(x2d: torch.Tensor, block: int, f16_scale: bool) -> torch.Tensor:
    """x [T, n] rounded to 8 bits per block: q = round(x * 127 / amax), value q * amax / 127 (the scale stored
    in f16 for Q8_0, f32 for Q8_K), as ggml's quantize_row_q8_0 / q8_K do."""
    x = x2d.float()
    t, n = x.shape
    xb = x.reshape(t, n // block, block)                                    # [T, n/block, block]
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.round(xb * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    d = amax / 127.0
    if f16_scale:
        d = d.half().float()
    return (q * d).reshape(t, n)


@contextmanager
def llamacpp_activation_rounding():
    """Inside: strata's CPU qmatmul first rounds its input as llama.cpp's CPU backend does before a quantized
    matmul (ggml's vec_dot_type): Q8_0 weights take Q8_0 activations (32 per block, f16 scale), K-quants take
    Q8_K (256 per block, f32 scale), F16 weights F16 activations; f32 weights take the input as it is. Uses
    qmatmul's kernel registry."""
    from gguf import GGMLQuantizationType as Q

    from strata.ops import registry
    from strata.quant.matmul import KERNELS, reference_qmatmul

    registry.load()  # the kernel modules fill KERNELS first, so that what is restored below is what they put there

    def kernel(block, f16_scale):
        return lambda x2d, w: reference_qmatmul(_round_like_llamacpp(x2d, block, f16_scale), w)

    plan = {Q.Q8_0: kernel(32, True), **{t: kernel(256, False) for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)},
            # f16 weights take f16 activations (in a q8_0 file: the tensors whose rows are no whole Q8_0 blocks)
            Q.F16: lambda x2d, w: reference_qmatmul(x2d.half().float(), w)}
    from strata.experts import resident

    saved = {("cpu", t): KERNELS.get(("cpu", t)) for t in plan}
    tokens = resident.CPU_NATIVE_TOKENS
    try:
        for t, fn in plan.items():
            KERNELS[("cpu", t)] = fn
        resident.CPU_NATIVE_TOKENS = 0  # every expert through qmatmul (so through the rounding above)
        yield
    finally:
        resident.CPU_NATIVE_TOKENS = tokens
        for key, fn in saved.items():
            if fn is None:
                KERNELS.pop(key, None)
            else:
                KERNELS[key] = fn
