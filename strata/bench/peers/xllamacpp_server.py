"""llama.cpp's server from the `xllamacpp` package (a CPU build), in this process, on a given port, until killed.

`python -m strata.bench.peers.xllamacpp_server --model M.gguf --port P [--ctx N --parallel N --threads N]`
serves llama.cpp's HTTP API (/health, /props, /v1/chat/completions with `cache_prompt` and `timings`,
/apply-template, /tokenize) on 127.0.0.1:P: the CPU peer for `strata bench --vs llamacpp`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ctx", type=int, default=4096, help="total context (llama.cpp splits it among the slots)")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)

    import xllamacpp as xlc

    c = xlc.CommonParams()
    c.model.path = a.model
    c.port = a.port
    c.n_ctx = a.ctx
    c.n_parallel = a.parallel
    c.n_gpu_layers = 0
    c.cpuparams.n_threads = a.threads
    c.cpuparams_batch.n_threads = a.threads
    c.use_jinja = True
    c.endpoint_props = True
    server = xlc.Server(c)
    addr = server.listening_address
    if not addr.endswith(f":{a.port}"):
        print(f"xllamacpp listens on {addr}, not on port {a.port}", file=sys.stderr)
        return 1
    print(f"llama.cpp (xllamacpp) listening on {addr}", file=sys.stderr, flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
