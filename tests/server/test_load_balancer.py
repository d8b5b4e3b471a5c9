"""The shipped nginx configuration (deploy/nginx-strata.conf) in front of two real `strata serve` replicas: a
conversation (its X-Session-Id) stays on one replica, requests without it are spread by client address, and when
a replica dies its conversations move to the other one. Skipped where nginx is not installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

CONF = Path(__file__).parents[2] / "deploy" / "nginx-strata.conf"


def _served(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _wait(port: int, p: subprocess.Popen) -> None:
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert p.poll() is None, "a replica exited"
        time.sleep(0.2)
    raise AssertionError(f"port {port} did not become ready")


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_keeps_a_conversation_on_one_replica(tiny_gguf, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STRATA_API_KEY": ""}
    ports = [free_port(), free_port()]
    front = free_port()
    replicas = [subprocess.Popen([sys.executable, "-m", "strata", "serve", "-m", str(tiny_gguf), "--port", str(p),
                                  "-c", "256", "--threads", "1", "--no-warmup"], env=env,
                                 stderr=subprocess.DEVNULL) for p in ports]
    conf = CONF.read_text()
    conf = conf.replace("127.0.0.1:8081", f"127.0.0.1:{ports[0]}").replace("127.0.0.1:8082", f"127.0.0.1:{ports[1]}")
    conf = conf.replace("listen 127.0.0.1:8080", f"listen 127.0.0.1:{front}")
    assert re.search(rf"listen 127.0.0.1:{front};", conf) and str(ports[1]) in conf
    for d in ("logs", "tmp"):
        (tmp_path / d).mkdir()
    temp = " ".join(f"{k}_temp_path {tmp_path}/tmp/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    whole = (f"worker_processes 1; pid {tmp_path}/nginx.pid; error_log {tmp_path}/logs/error.log;\n"
             f"events {{}}\nhttp {{ access_log off; {temp}\n{conf}\n}}\n")
    (tmp_path / "nginx.conf").write_text(whole)
    nginx = None
    try:
        for p, proc in zip(ports, replicas):
            _wait(p, proc)
        nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g",
                                  "daemon off;"], stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{front}/v1/completions"
        t0 = time.time()
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{front}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.time() - t0 < 30 and nginx.poll() is None, nginx.stderr.read() if nginx.poll() else ""
                time.sleep(0.1)
        home = {}
        for sid in ("alice", "bob", "carol", "dave"):
            before = [_served(p) for p in ports]
            for i in range(3):
                r = httpx.post(url, json={"prompt": f"{sid} says {i}", "max_tokens": 2}, timeout=60,
                               headers={"X-Session-Id": sid})
                assert r.status_code == 200, r.text
            grew = [_served(p) - b for p, b in zip(ports, before)]
            assert sorted(grew) == [0, 3], (sid, grew)  # all three on one replica
            home[sid] = grew.index(3)
        # a replica dies: its conversations go on on the other one
        victim = home["alice"]
        replicas[victim].kill()
        replicas[victim].wait()
        for _ in range(2):
            r = httpx.post(url, json={"prompt": "alice again", "max_tokens": 2}, timeout=60,
                           headers={"X-Session-Id": "alice"})
            assert r.status_code == 200, r.text
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(timeout=10)
        for proc in replicas:
            proc.terminate()
            proc.wait(timeout=30)
