"""A server with n-gram speculative decoding (--draft-max) against the same server without it: the official
openai client gets the same greedy text, streamed and not, with every token of a multi-token step delivered and
the request ending at exactly max_tokens; timings and /metrics count the drafts."""

from __future__ import annotations

import dataclasses

import httpx
import openai

from .conftest import serve

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
MSG = [{"role": "user", "content": "Repeat this code twice:\n" + CODE + CODE}]


def _ask(url: str, stream: bool, n: int, **extra):
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    if not stream:
        r = c.chat.completions.create(model="tiny", messages=MSG, max_tokens=n, temperature=0, extra_body=extra)
        return r.choices[0].message.content, r.usage.completion_tokens, r.model_extra["timings"]
    chunks = list(c.chat.completions.create(model="tiny", messages=MSG, max_tokens=n, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks[-1].usage.completion_tokens, None


def test_drafts_give_the_same_text_and_are_counted(lm):
    drafting = dataclasses.replace(lm, cfg=dataclasses.replace(lm.cfg, draft_max=6))
    with serve(lm, parallel=1) as plain:
        ref = _ask(plain.url, False, 40)
        assert ref[2]["draft_n"] == 0
        # llama.cpp's per-request field turns drafts on for one request of a server started without them
        own = _ask(plain.url, False, 40, **{"speculative.n_max": 6})
        assert own[:2] == ref[:2] and own[2]["draft_n"] > 0
        r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MSG, "speculative.n_max": -1})
        assert r.status_code == 400 and "speculative.n_max" in r.text
    with serve(drafting, parallel=1) as s:
        params = httpx.get(s.url + "/props").json()["default_generation_settings"]["params"]
        assert params["speculative.n_max"] == 6
        text, n, t = _ask(s.url, False, 40)
        assert (text, n) == ref[:2] and n == 40
        assert t["predicted_n"] == 40 and t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        assert t["draft_source"] == "ngram" and ref[2]["draft_source"] is None
        assert _ask(s.url, True, 40)[:2] == ref[:2]
        for n in (1, 7):  # a step that would give more tokens than are left stops at max_tokens
            assert _ask(s.url, False, n)[1] == n
        off = _ask(s.url, False, 40, **{"speculative.n_max": 0})  # and off for one request
        assert off[:2] == ref[:2] and off[2]["draft_n"] == 0
        m = httpx.get(s.url + "/metrics").text
        line = next(x for x in m.splitlines() if x.startswith("vllm:spec_decode_num_draft_tokens_total"))
        assert float(line.split()[-1]) >= t["draft_n"]
        # what the draft-length choice has measured: a step's cost by its token count
        cost = httpx.get(s.url + "/props").json()["decode_steps"]["verify_cost_ms"]
        assert cost is not None and cost["one_token"] > 0 and cost["per_draft"] >= 0
