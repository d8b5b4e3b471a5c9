"""Log-probabilities (OpenAI chat `logprobs`/`top_logprobs`, the completions API's legacy `logprobs`) and `n`
choices, against a real server on loopback, read with the official openai client.

The oracle for log-probabilities is independent of the server's decode path: a full prefill forward of the whole
context, recomputed from scratch for every token, and torch's log_softmax in float64.
"""

from __future__ import annotations

import codecs
import json
import math

import httpx
import openai
import pytest
import torch

from .conftest import CTX

pytestmark = pytest.mark.exact_cpu  # float oracles: CPU qmatmul stays the float32 reference

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
_http = httpx.Client(timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@torch.inference_mode()
def oracle(lm, prompt: list[int], n: int, k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Greedy decoding by full forwards: [(token, its logprob, top k (id, logprob))] for n tokens."""
    from strata.kv.cache import Segment

    kv = lm.model.new_kv_cache(1, CTX, lm.cfg.torch_kv_dtype)
    ids, out = list(prompt), []
    for _ in range(n):
        logits = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), [Segment(0, 0, len(ids))], kv,
                                  all_logits=True)[-1]
        lp = torch.log_softmax(logits.double(), -1)
        top = lp.topk(k)
        nxt = int(lp.argmax())
        out.append((nxt, float(lp[nxt]), list(zip(top.indices.tolist(), top.values.tolist()))))
        ids.append(nxt)
    return out


def _text(lm, i: int) -> str:
    return lm.tokenizer.token_bytes(i).decode("utf-8", errors="replace")


def _legacy(lm, i: int) -> str:
    """The legacy format's name of a token: its text, or "bytes:\\xNN..." for bytes that are not UTF-8 alone."""
    b = lm.tokenizer.token_bytes(i)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def test_chat_logprobs_match_the_oracle(server, oai, lm):
    srv = server.state.server
    prompt = srv.encode_chat(srv.render(MSG, None, None))
    want = oracle(lm, prompt, 6, 3)
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3)
    got = r.choices[0].logprobs.content
    assert len(got) == 6
    for e, (tid, lp, top) in zip(got, want):
        assert bytes(e.bytes) == lm.tokenizer.token_bytes(tid) and e.token == _text(lm, tid)
        assert math.isclose(e.logprob, lp, abs_tol=2e-3), (e.logprob, lp)
        assert [bytes(t.bytes) for t in e.top_logprobs] == [lm.tokenizer.token_bytes(i) for i, _ in top]
        for t, (_, v) in zip(e.top_logprobs, top):
            assert math.isclose(t.logprob, v, abs_tol=2e-3)
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the drawn token is the likeliest
    assert b"".join(bytes(e.bytes) for e in got).decode("utf-8", "replace") == r.choices[0].message.content
    # streamed: each chunk carries its tokens' log-probabilities; together they are the same
    chunks = list(oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in got]
    # (the prompt now comes from the cache: the last prompt token is computed alone, to float rounding)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in got], abs=1e-4)
    # logprobs without alternatives, and none unless asked
    r0 = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in r0.choices[0].logprobs.content] == [[], [], []]
    assert oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=3).choices[0].logprobs is None


def test_logprobs_are_of_the_raw_logits_when_sampling(oai):
    """Sampled with temperature and top-k, the reported distribution is still the model's own: its top
    alternatives' probabilities sum to at most 1, and the drawn token's logprob is among them or below."""
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=1.5, seed=4,
                                    logprobs=True, top_logprobs=20, extra_body={"top_k": 5})
    for e in r.choices[0].logprobs.content:
        vals = [t.logprob for t in e.top_logprobs]
        assert vals == sorted(vals, reverse=True) and sum(math.exp(v) for v in vals) <= 1 + 1e-4
        # not the sampler's distribution: that one is cut to 5 tokens (the rest -inf) and sums to 1 over them
        assert vals[19] > -100 and sum(math.exp(v) for v in vals[:5]) < 0.99
        assert e.logprob <= vals[0] + 1e-6 and e.logprob >= vals[4] - 1e-6  # top_k 5: one of the five likeliest


def test_completions_legacy_logprobs(server, lm):
    prompt = lm.tokenizer.encode("Once upon a time", add_special=False)
    want = oracle(lm, prompt, 5, 2)
    r = _http.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                          "logprobs": 2})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert lp["tokens"] == [_legacy(lm, t) for t, _, _ in want]
    for v, (_, w, top) in zip(lp["token_logprobs"], want):
        assert math.isclose(v, w, abs_tol=2e-3)
    for d, (_, _, top) in zip(lp["top_logprobs"], want):
        assert list(d) == [_legacy(lm, i) for i, _ in top]
    # where each token starts in the text: the characters the tokens before it decode to
    dec, offsets, n = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
    for t, _, _ in want:
        offsets.append(n)
        n += len(dec.decode(lm.tokenizer.token_bytes(t)))
    assert lp["text_offset"] == offsets
    assert b"".join(lm.tokenizer.token_bytes(t) for t, _, _ in want).decode("utf-8", "replace") == ch["text"]
    # the official client parses it; streamed, the offsets run on across chunks
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    s = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, stream=True))
    parts = [x.choices[0].logprobs for x in s if x.choices and x.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp["tokens"]
    assert sum((p.text_offset for p in parts), []) == lp["text_offset"]
    assert sum((p.token_logprobs for p in parts), []) == pytest.approx(lp["token_logprobs"], abs=1e-4)


def test_legacy_logprobs_of_byte_tokens(server, lm):
    """Tokens that are pieces of a character: each one's text_offset is where its character starts in the text (a
    token never starts inside a character), they are named by their bytes, and alternatives that are such pieces
    keep distinct keys in top_logprobs."""
    tok = lm.tokenizer
    ids = tok.encode("😀😀", add_special=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert len(ids) == 6 and all(not _utf8(b) for b in pieces), pieces  # the test needs byte pieces
    # a grammar fixes the text; the bias picks these pieces among the tokenizations it allows
    body = {"prompt": "😀😀😀😀😀😀😀😀 🎉🎉🎉🎉 ", "max_tokens": 10, "temperature": 0, "logprobs": 20,
            "grammar": 'root ::= "😀😀\\"x"', "logit_bias": {str(i): 100 for i in set(ids)}}
    r = _http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == '😀😀"x'
    assert lp["tokens"][:6] == [_legacy(lm, i) for i in ids] and lp["tokens"][0] == "bytes:\\xf0\\x9f"
    assert lp["text_offset"] == [0, 0, 0, 1, 1, 1, 2, 3]
    for off, t in zip(lp["text_offset"][6:], lp["tokens"][6:]):
        assert ch["text"][off:off + len(t)] == t
    # 20 distinct alternatives (as many keys), the piece tokens among them too
    assert all(len(d) == 20 for d in lp["top_logprobs"]), [len(d) for d in lp["top_logprobs"]]
    assert any(k.startswith("bytes:") for d in lp["top_logprobs"] for k in d)
    # streamed: the same offsets across chunks
    s = _http.post(server.url + "/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(x[6:]) for x in s.text.split("\n\n") if x.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    # the chat API's entries keep each token's own bytes
    c = _http.post(server.url + "/v1/chat/completions", json={
        "messages": MSG, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "grammar": body["grammar"], "logit_bias": body["logit_bias"]}).json()["choices"][0]
    assert c["message"]["content"] == '😀😀"x'
    assert [bytes(e["bytes"]) for e in c["logprobs"]["content"]][:6] == pieces


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": MSG, "n": 3}, "at most 2"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "--parallel 2"),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}, "n"),
])
def test_bad_logprobs_and_n_are_400(server, path, body, fragment):
    r = _http.post(server.url + path, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.json()


def test_n_choices(oai):
    kw = dict(model="tiny", messages=MSG, max_tokens=6, temperature=1.0, seed=11)
    r = oai.chat.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    texts = [c.message.content for c in r.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    # choice i is the one-choice answer with seed + i, every time
    assert [oai.chat.completions.create(**{**kw, "seed": 11 + i}).choices[0].message.content for i in (0, 1)] == texts
    chunks = list(oai.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts
    assert chunks[-1].usage.completion_tokens == 12
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1]


def test_n_with_a_grammar_and_logprobs(oai, server):
    """Each choice follows its own grammar state and reports its own tokens."""
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=8, temperature=1.5, seed=2, n=2,
                                    logprobs=True, extra_body={"grammar": 'root ::= "yes" | "no" | "maybe"'})
    for c in r.choices:
        assert c.message.content in ("yes", "no", "maybe") and c.finish_reason == "stop"
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
    out = _http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "n": 2, "seed": 1,
                                                            "temperature": 1.0}).json()
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 8
    assert json.dumps(out)  # plain JSON (no NaN / Infinity)


def test_n_streamed_client_leaving_frees_every_slot(server):
    """A client that leaves a stream of n choices mid-way cancels all of them: both slots are idle again."""
    import time

    body = {"messages": MSG, "max_tokens": 400, "n": 2, "stream": True, "temperature": 1.0, "ignore_eos": True,
            "seed": 5}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                # a sampled choice may open with reasoning: any generated text counts
                seen.update(ch["index"] for ch in json.loads(line[6:])["choices"]
                            if ch["delta"].get("content") or ch["delta"].get("reasoning_content"))
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen  # left mid-way, not after the end
        assert _http.get(server.url + "/health").json()["slots_processing"] == 2  # both were generating
    t0 = time.time()
    while time.time() - t0 < 20:
        h = _http.get(server.url + "/health").json()
        if h["slots_idle"] == 2:
            break
        time.sleep(0.1)
    assert h["slots_idle"] == 2 and h["slots_processing"] == 0, h
