"""/slots and /health while a slot changes hands, on a real server on loopback: a request whose slot the
conversation cache is saving and restoring (a copy of gigabytes on a large model) is processing in that slot, as
llama-server reports a slot from the moment it takes a task, not an idle slot beside an empty queue."""

from __future__ import annotations

import httpx

from .conftest import serve


def test_a_slot_being_restored_from_the_conversation_cache_is_its_requests(lm):
    with serve(lm, parallel=1) as s:
        fresh = httpx.get(s.url + "/slots", timeout=30).json()
        assert [(x["is_processing"], x["state"], x["id_task"], x["n_prompt_tokens"]) for x in fresh] == \
            [(False, "idle", -1, 0)]  # (no task yet)
        cache = s.state.server.worker.cache
        seen = []
        real_restore = cache._restore

        def restore(engine, slot, entry, n):
            # what a client polling the server sees while the copies run (asked from the engine thread, which is
            # inside them; the event loop answers)
            seen.append((httpx.get(s.url + "/slots", timeout=30).json(), httpx.get(s.url + "/health", timeout=30).json()))
            real_restore(engine, slot, entry, n)
            seen.append((httpx.get(s.url + "/slots", timeout=30).json(), httpx.get(s.url + "/health", timeout=30).json()))

        cache._restore = restore  # (the real restore runs; this only looks at the server in the middle of it)
        c = httpx.Client(timeout=60)

        def chat(messages):
            return c.post(s.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                                 "max_tokens": 3, "temperature": 0}).json()

        convo = [{"role": "user", "content": "Tell me about rivers and hills. " * 10}]
        first = chat(convo)
        other = chat([{"role": "user", "content": "Unrelated: what is two and two? " * 5}])  # the slot goes to another
        idle = c.get(s.url + "/slots").json()
        # an idle slot shows its last task, as llama-server's does (its id, prompt and tokens; the KV it holds)
        (last,) = idle
        assert (last["is_processing"], last["state"]) == (False, "idle") and last["id_task"] >= 0
        assert last["n_prompt_tokens"] == other["usage"]["prompt_tokens"]
        assert last["n_decoded"] == other["usage"]["completion_tokens"] == last["next_token"][0]["n_decoded"]
        assert last["n_prompt_tokens_processed"] + last["n_prompt_tokens_cache"] == last["n_prompt_tokens"]
        assert last["next_token"][0]["has_next_token"] is False
        convo += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        second = chat(convo)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 16  # (it came from the RAM copy)
        assert len(seen) == 2
        tasks = set()
        for slots, health in seen:
            (slot,) = slots
            assert slot["is_processing"] and slot["state"] == "reading", slot
            assert slot["n_prompt_tokens"] == second["usage"]["prompt_tokens"] and slot["n_decoded"] == 0
            assert slot["n_cached"] == 0  # (nothing of the new request's is in the slot before it is placed)
            tasks.add(slot["id_task"])
            assert (health["slots_idle"], health["slots_processing"], health["requests_waiting"]) == (0, 1, 0)
        assert len(tasks) == 1 and -1 not in tasks and last["id_task"] not in tasks  # (a task of its own)
        after = c.get(s.url + "/slots").json()
        assert after[0]["state"] == "idle" and after[0]["n_cached"] >= second["usage"]["prompt_tokens"]


def test_a_slots_counts_while_its_prompt_is_read_and_its_reply_decoded(lm):
    """A second turn reusing the first's prefix, asked after every engine step: n_cached is the prompt tokens it
    reused, all along (it was the KV's length, past the prompt's size once decoding: the monitor's "cached" column
    read more than the prompt), n_past the KV's length, n_prompt_tokens_processed the prompt tokens read so far."""
    with serve(lm, parallel=1, prefill_chunk=16) as s:
        eng = s.state.server.worker.engine
        seen = []
        real_step = eng.step

        def step():
            out = real_step()
            seen.append(httpx.get(s.url + "/slots", timeout=30).json()[0])  # (the engine thread waits; the loop answers)
            return out

        c = httpx.Client(timeout=60)

        def chat(messages, n):
            return c.post(s.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": n,
                                                                 "temperature": 0, "ignore_eos": True}).json()

        convo = [{"role": "user", "content": "Tell me about rivers and hills. " * 6}]
        first = chat(convo, 3)
        convo += [first["choices"][0]["message"], {"role": "user", "content": "And then? " * 12}]
        eng.step = step
        second = chat(convo, 6)
        eng.step = real_step
        n_prompt, cached = second["usage"]["prompt_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 16 and n_prompt - cached > 2 * 16  # (a prefix reused; the rest read in several chunks)
        busy = [x for x in seen if x["is_processing"]]
        reading = [x for x in busy if x["state"] == "reading"]
        generating = [x for x in busy if x["state"] == "generating"]
        assert len(reading) >= 2 and len(generating) >= 2
        for x in busy:
            assert x["n_prompt_tokens"] == n_prompt and x["n_cached"] == x["n_prompt_tokens_cache"] == cached, x
            assert x["next_token"][0]["n_remain"] == 6 - x["n_decoded"]
        for x in reading:
            assert x["n_past"] == cached + x["n_prompt_tokens_processed"] < n_prompt and x["n_decoded"] == 0, x
        for x in generating:
            assert x["n_prompt_tokens_processed"] == n_prompt - cached
            assert x["n_past"] == n_prompt + x["n_decoded"] - 1, x  # (the last token drawn is not in the KV yet)
        assert [x["n_prompt_tokens_processed"] for x in reading] == sorted(x["n_prompt_tokens_processed"]
                                                                         for x in reading)
