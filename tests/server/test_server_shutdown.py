"""Ctrl-C on `strata serve` (a real process) while streams are open: each stream ends as its API says a failed
stream ends (OpenAI: an error event, then [DONE]; Anthropic: an error event), the log holds no traceback, and the
process exits promptly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from .conftest import free_port

MSG = [{"role": "user", "content": "Talk for a long time."}]
# long enough that the streams are still running when the signal comes (the tiny model writes ~500 tokens/s)
CTX = 8192


def _stream(url: str, path: str, body: dict, lines: list, started: threading.Event) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if sum(ln.startswith("data: ") for ln in lines) >= 5:
                started.set()


def test_sigint_ends_open_streams_cleanly(tiny_gguf, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    env.pop("STRATA_TEST_FAULT_AFTER_TOKENS", None)
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "strata", "serve", "-m", str(tiny_gguf), "--port", str(port),
                              "-np", "2", "-c", str(CTX), "--threads", "1", "--no-warmup"],
                             env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        t0 = time.time()
        while True:
            assert p.poll() is None, log.read_text()
            assert time.time() - t0 < 120, "strata serve did not become ready"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        streams = {
            "/v1/chat/completions": {"messages": MSG, "max_tokens": CTX - 100, "ignore_eos": True, "stream": True},
            # (greedy: this reply runs to max_tokens without an end of turn)
            "/v1/messages": {"messages": MSG, "max_tokens": CTX - 100, "temperature": 0, "stream": True},
        }
        got = {path: [] for path in streams}
        events = {path: threading.Event() for path in streams}
        threads = [threading.Thread(target=_stream, args=(url, path, body, got[path], events[path]))
                   for path, body in streams.items()]
        for t in threads:
            t.start()
        for e in events.values():
            assert e.wait(60), got
        p.send_signal(signal.SIGINT)
        t_sig = time.time()
        for t in threads:
            t.join(30)
        rc = p.wait(timeout=30)
        exit_s = time.time() - t_sig
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text and "Cancel" not in text, text
    # promptly (no "Cancel" above: uvicorn's grace period did not run out), as Ctrl-C ends a command: 130
    assert exit_s < 5, (exit_s, text)
    assert rc == 130 and text.rstrip().endswith("strata: interrupted"), (rc, text)

    data = [ln[6:] for ln in got["/v1/chat/completions"] if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    err = json.loads(data[-2])["error"]
    assert "shutting down" in err["message"], err
    assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data[:-2])

    lines = got["/v1/messages"]
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names, names[-3:]
    err = json.loads([ln for ln in lines if ln.startswith("data: ")][-1][6:])
    assert err["type"] == "error" and err["error"]["type"] == "overloaded_error", err
    assert "shutting down" in err["error"]["message"]
