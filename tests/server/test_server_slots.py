"""/slots and /health while a slot changes hands, on a real server on loopback: a request whose slot the
conversation cache is saving and restoring (a copy of gigabytes on a large model) is processing in that slot, as
llama-server reports a slot from the moment it takes a task, not an idle slot beside an empty queue."""

from __future__ import annotations

import httpx

from .conftest import serve


def test_a_slot_being_restored_from_the_conversation_cache_is_its_requests(lm):
    with serve(lm, parallel=1) as s:
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
        chat([{"role": "user", "content": "Unrelated: what is two and two? " * 5}])  # the slot goes to another
        idle = c.get(s.url + "/slots").json()
        assert [(x["is_processing"], x["state"], x["id_task"]) for x in idle] == [(False, "idle", -1)]
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
        assert len(tasks) == 1 and -1 not in tasks
        after = c.get(s.url + "/slots").json()
        assert after[0]["state"] == "idle" and after[0]["n_cached"] >= second["usage"]["prompt_tokens"]
