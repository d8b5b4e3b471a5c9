"""Run llama.cpp (the `xllamacpp` build) on one GGUF file in a child process.

Usage: python llamacpp_worker.py JOB.json RESULT.json (llama.cpp's log goes to stderr).

A child process because llama.cpp aborts the whole process on an internal assertion (GGML_ASSERT) when a
file's metadata and tensors disagree; the test then sees a failed child with llama.cpp's message instead of
a dead pytest.

Job: {"model": PATH, "threads": 2, "ctx": 256, "force_token": ID, "requests": [REQ, ...]}, REQ one of
  {"op": "greedy", "prompt": [ids], "n": N}        -> {"tokens": [<= N ids, up to an end-of-generation]}
  {"op": "top", "prompts": [[ids], ...], "k": K}   -> {"top": [[[id, logprob] x K] per prompt]}

Both go to the server's native `/completion` endpoint on loopback (the server xllamacpp starts in-process).
The OpenAI-style in-process handler is not used: it withholds or merges per-token entries whose bytes are not
complete UTF-8, and a tiny byte-level vocabulary predicts such tokens all the time. "top" asks for one token
per prompt with `n_probs` and `post_sampling_probs: false`, which reports the log-softmax of the raw logits
(the sampler chain does not touch them); the sampled token itself is forced to an ASCII token with a logit
bias only so that its text is complete UTF-8 and the probabilities are always sent.
"""

from __future__ import annotations

import json
import sys
import urllib.request


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        res = json.loads(r.read())
    if res.get("tokens_evaluated") != len(body["prompt"]):  # e.g. a BOS put in front of the given ids
        raise RuntimeError(f"llama.cpp evaluated {res.get('tokens_evaluated')} prompt tokens for "
                           f"{len(body['prompt'])} ids")
    return res


def main() -> int:
    import xllamacpp as xlc

    job = json.loads(open(sys.argv[1]).read())
    p = xlc.CommonParams()
    p.model.path = job["model"]
    p.n_ctx = int(job.get("ctx", 256))
    p.n_parallel = 1
    p.n_gpu_layers = 0
    p.cpuparams.n_threads = int(job.get("threads", 2))
    p.cpuparams_batch.n_threads = int(job.get("threads", 2))
    p.warmup = False
    # float32 KV cache and no flash attention: llama.cpp's defaults (f16 KV) would round K and V, which strata
    # keeps in float32 on CPU; with these the float-weight comparison is exact up to summation order.
    p.cache_type_k = xlc.ggml_type.GGML_TYPE_F32
    p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    server = xlc.Server(p)
    base = server.listening_address
    force = int(job["force_token"])  # any token whose text is complete UTF-8
    out = []
    for r in job["requests"]:
        if r["op"] == "greedy":
            res = _post(base, {"prompt": r["prompt"], "n_predict": r["n"], "temperature": 0.0, "top_k": 1,
                               "repeat_penalty": 1.0, "return_tokens": True, "cache_prompt": False})
            out.append({"tokens": res["tokens"]})
        elif r["op"] == "top":
            tops = []
            for prompt in r["prompts"]:
                res = _post(base, {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "n_probs": r["k"],
                                   "post_sampling_probs": False, "logit_bias": [[force, 1e4]],
                                   "cache_prompt": True})
                probs = res["completion_probabilities"]
                if len(probs) != 1:
                    raise RuntimeError(f"expected one token's probabilities, got {len(probs)}")
                tops.append([[t["id"], t["logprob"]] for t in probs[0]["top_logprobs"]])
            out.append({"top": tops})
        else:
            raise ValueError(f"unknown op {r['op']!r}")
    with open(sys.argv[2], "w") as f:
        json.dump({"results": out}, f)
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
