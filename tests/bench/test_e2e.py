"""The bench end to end on the tiny model: a real strata server on loopback, llama.cpp's server (xllamacpp) as the
peer, the CLI writing JSON, Markdown and PNG plots."""

import asyncio
import importlib.util
import json
import math

import pytest

from strata import StrataError
from strata.bench.client import BenchClient, strata_server
from strata.bench.prompts import PromptBuilder
from strata.bench.sweep import check_uncached
from strata.cli import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("strata.server.app") is None,
                                reason="the server (strata.server.app) is not in this tree yet")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(hf_and_gguf):
    return str(hf_and_gguf("qwen3moe")[1])


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-server") / "serve.log"
    # one torch thread: on a shared 2-core machine a busy neighbour stalls every multi-threaded op of a tiny model
    # on the CPU also on a GPU machine: llama.cpp's peer here is its CPU build (xllamacpp)
    with strata_server(tiny, ["--device", "cpu", "--expert-slots", "4", "-c", "512", "--threads", "1"], log,
                       parallel=2) as proc:
        yield proc.url


def test_counter_agrees_with_the_engine(server):
    """The token count the prompts are built with is the count the engine prefills, and the engine's timings
    arrive through the stream."""
    c = BenchClient(server)
    try:
        p = PromptBuilder(c.count_tokens, tag="t").build(150)
        assert c._counter == "strata"  # the count route, not a generation
        rep = c.chat([{"role": "user", "content": p.text}], 4, ignore_eos=True)
        assert rep.error is None and rep.prompt_tokens == p.tokens == 150
        assert rep.timings["prompt_n"] == 150 and rep.cached_tokens == 0
        assert rep.completion_tokens == rep.timings["predicted_n"] >= 2
        assert rep.decode_tok_s > 0 and rep.prefill_tok_s > 0
        assert 0 < rep.ttft_s <= rep.wall_s
    finally:
        c.close()


def test_a_cached_prompt_is_caught(server):
    """The same prompt twice with the server's prompt cache on: the engine reuses it and the sweep's check
    refuses the numbers; with unique first lines and cache_prompt false nothing is reused."""
    c = BenchClient(server)
    try:
        b = PromptBuilder(c.count_tokens, tag="t")
        text = b.build(120).text
        c.chat([{"role": "user", "content": text}], 2, cache_prompt=True)
        again = c.chat([{"role": "user", "content": text}], 2, cache_prompt=True)
        assert again.cached_tokens > 0
        with pytest.raises(StrataError, match="cached prompt tokens"):
            check_uncached(again, "test")
        fresh = c.chat([{"role": "user", "content": b.build(120).text}], 2, cache_prompt=False)
        check_uncached(fresh, "test")
    finally:
        c.close()


def test_bench_all_suites_with_llamacpp_peer(server, tmp_path):
    rc = main(["bench", "all", "--url", server, "--name", "e2e", "--out", str(tmp_path), "--lengths", "64,200",
               "--runs", "2", "--gen", "4", "--workers", "1,2", "--conc-prompt", "64", "--conc-gen", "4",
               "--conc-requests", "1", "--needle-lengths", "256", "--depths", "50", "--sanity-tokens", "4",
               "--vs", "llamacpp", "--peer-threads", "1"])
    assert rc == 0
    (out,) = tmp_path.iterdir()
    for name in ("results.json", "results.md", "sweep.png", "concurrency.png", "needle.png"):
        assert (out / name).stat().st_size > 100, name
    for name in ("sweep.png", "concurrency.png", "needle.png"):
        assert (out / name).read_bytes()[:8] == PNG
    res = json.loads((out / "results.json").read_text())
    assert res["format"] == "strata-bench" and res["machine"]["check"]["cpu"]["cores_logical"] >= 1
    assert res["model"]["footprint"]["n_expert"] == 8
    sweep = res["suites"]["sweep"]
    assert [r["length"] for r in sweep["rows"]] == [64, 200]
    for row in sweep["rows"]:
        assert len(row["runs"]) == 2 and len(row["warmup"]) == 1
        for r in row["runs"]:
            assert r["cache_n"] == 0  # nothing reused
            assert r["prompt_tokens"] == row["length"]  # sizes exact
            assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_s"] > 0
        assert row["prefill_tok_s"]["min"] <= row["prefill_tok_s"]["median"] <= row["prefill_tok_s"]["max"]
        assert row["experts"]  # the server's expert statistics were read
    conc = res["suites"]["concurrency"]
    assert [lv["workers"] for lv in conc["levels"]] == [1, 2] and all(lv["errors"] == 0 for lv in conc["levels"])
    assert conc["levels"][1]["requests"] == 2 and conc["levels"][1]["aggregate_tok_s"] > 0
    needle = res["suites"]["needle"]
    assert len(needle["cells"]) == 1 and "trained model" in needle["note"]
    sanity = res["suites"]["sanity"]
    assert sanity["total"] == 12 and {c["kind"] for c in sanity["cases"]} == {"instruction", "retrieval", "tool"}
    peer = res["peers"]["llamacpp"]
    assert "error" not in peer, peer.get("error")
    assert peer["routing"] == "model"
    assert [r["length"] for r in peer["suites"]["sweep"]["rows"]] == [64, 200]
    assert all(r["cache_n"] == 0 for row in peer["suites"]["sweep"]["rows"] for r in row["runs"])
    ratios = res["ratios"]["llamacpp"]
    assert [x["length"] for x in ratios["sweep"]] == [64, 200]
    for x in ratios["sweep"]:
        assert math.isfinite(x["prefill"]) and math.isfinite(x["decode"]) and x["decode"] > 0
    md = (out / "results.md").read_text()
    for heading in ("## Prefill / decode sweep", "## Concurrency", "## Needle in a haystack", "## Sanity",
                    "### llamacpp", "strata / llamacpp"):
        assert heading in md

    # the sanity set against this run as baseline: the same greedy answers, nothing regressed
    rc = main(["bench", "sanity", "--url", server, "--name", "again", "--out", str(tmp_path), "--sanity-tokens", "4",
               "--baseline", str(out / "results.json")])
    assert rc == 0
    again = json.loads(next(p for p in tmp_path.iterdir() if p.name.endswith("again")).joinpath("results.json")
                       .read_text())
    cmp = again["suites"]["sanity"]["compare"]
    assert cmp["regressed"] == [] and cmp["changed"] == []


def test_bench_starts_its_own_server(tiny, tmp_path):
    """With --routing uniform the server it starts routes every token to random experts (and says so in its log);
    the results carry the routing and the seed."""
    rc = main(["bench", "sweep", "-m", tiny, "--expert-slots", "4", "--cpu-threads", "1", "--name", "own", "--out", str(tmp_path),
               "--lengths", "100", "--runs", "1", "--gen", "3", "--routing", "uniform", "--seed", "7",
               "--temperature", "0.5"])
    assert rc == 0
    out = next(tmp_path.iterdir())
    res = json.loads(out.joinpath("results.json").read_text())
    (phase,) = res["server"]["phases"]
    assert phase["suites"] == ["sweep"] and phase["parallel"] == 1
    argv = phase["argv"]
    assert argv[argv.index("--expert-slots") + 1] == "4" and argv[argv.index("-c") + 1] == str(phase["ctx"])
    flags = res["server"]["flags"]  # the engine flags given, in the parser's order
    assert sorted(zip(flags[::2], flags[1::2])) == [("--cpu-threads", "1"), ("--expert-routing", "uniform"),
                                                    ("--expert-slots", "4")]
    assert res["suites"]["sweep"]["rows"][0]["prompt_tokens"] == [100]
    assert (res["routing"], res["seed"], res["suites"]["sweep"]["config"]["seed"]) == ("uniform", 7, 7)
    assert phase["server"]["settings"]["expert_routing"] == "uniform"  # what the server itself reports
    log = next((out / "logs").iterdir()).read_text()
    assert sum("WARNING: --expert-routing uniform" in line for line in log.splitlines()) == 1
    md = out.joinpath("results.md").read_text()
    assert "seed 7 (concurrency worker i: seed 7 + i); strata's expert routing: **uniform**" in md
    assert "temperature 0.5 (top-k 40, top-p 0.95, min-p 0.05, seed 7)" in md


def test_a_length_past_the_models_context_is_refused_before_any_server_starts(tiny, tmp_path, capsys):
    """Not two servers loaded only to skip the row: one line naming the context it needs and the flag that runs it."""
    rc = main(["bench", "sweep", "-m", tiny, "--out", str(tmp_path), "--lengths", "128K", "--runs", "1"])
    assert rc != 0
    err = capsys.readouterr().err
    assert "sweep: every length asked for needs more context than the model's trained" in err, err
    assert "pass -c 131328" in err, err
    assert not list((tmp_path).rglob("*.log"))  # no server was started


def test_lengths_that_partly_fit_the_context_run_and_skip_the_rest():
    """The default lengths on a short-context model: those that fit run, the rest are skipped with a note (only a
    suite with nothing to run is refused up front)."""
    from types import SimpleNamespace

    from strata.bench.cli import _past_context

    sweep = SimpleNamespace(lengths=(1024, 4096, 32768), gen=128)
    needle = SimpleNamespace(lengths=(4096,), gen=16)
    _past_context(SimpleNamespace(suites=["sweep"], sweep=sweep, needle=needle), 2048)  # (1K fits)
    with pytest.raises(StrataError, match="needle: every length"):
        _past_context(SimpleNamespace(suites=["sweep", "needle"], sweep=sweep, needle=needle), 2048)


def test_bench_refuses_a_server_that_is_not_there(tmp_path):
    with pytest.raises(StrataError, match="not ready"):
        from strata.cli import build_parser

        args = build_parser().parse_args(["bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)])
        args.func(args)


def test_sampled_requests_carry_one_sampler_chain_for_every_server():
    from strata.bench.client import chat_body, sampling

    greedy = chat_body([{"role": "user", "content": "x"}], 4, **sampling(0))
    assert greedy["temperature"] == 0 and greedy["top_k"] == 1 and "min_p" not in greedy
    hot = chat_body([{"role": "user", "content": "x"}], 4, **sampling(0.8))
    assert (hot["temperature"], hot["top_k"], hot["top_p"], hot["min_p"], hot["seed"]) == (0.8, 40, 0.95, 0.05, 0)
    with pytest.raises(StrataError, match="temperature"):
        sampling(-1)


def test_bench_sampled_text_through_the_server(server, tmp_path):
    rc = main(["bench", "sweep", "concurrency", "--url", server, "--name", "hot", "--out", str(tmp_path),
               "--temperature", "0.8", "--lengths", "64", "--runs", "1", "--warmup", "0", "--gen", "4",
               "--workers", "1,2", "--conc-prompt", "64", "--conc-gen", "4", "--conc-requests", "1", "--seed", "5"])
    assert rc == 0
    out = next(tmp_path.iterdir())
    res = json.loads(out.joinpath("results.json").read_text())
    assert res["suites"]["sweep"]["config"]["temperature"] == 0.8
    assert res["suites"]["concurrency"]["config"]["temperature"] == 0.8
    levels = res["suites"]["concurrency"]["levels"]
    assert [lv["errors"] for lv in levels] == [0, 0]
    # one seed for the run, recorded; each concurrent worker its own
    assert res["seed"] == 5 and res["suites"]["sweep"]["config"]["seed"] == 5
    assert res["suites"]["concurrency"]["config"]["seed"] == 5 and [lv["seeds"] for lv in levels] == [[5], [5, 6]]
    assert res["routing"] == "model"  # as the running server reports it
    md = out.joinpath("results.md").read_text()
    assert md.count("sampled at temperature 0.8") == 2 and md.count("min-p 0.05, seed 5)") == 2
    assert "temperature 0.8, sampled, seed 5" in md and "strata's expert routing: the model's router" in md


def test_sampled_workers_draw_different_text(server):
    """Two concurrency workers with the same prompt at a temperature write two texts (seeds 11 and 12), where one
    seed writes one text twice."""
    from strata.bench.client import sampling
    from strata.bench.concurrency import _level

    c = BenchClient(server)
    try:
        text = PromptBuilder(c.count_tokens, tag="seeds").build(80).text
        got = asyncio.run(_level(c, [[text], [text]], 12, 1.5, seed=11))
        same = [c.chat([{"role": "user", "content": text}], 12, cache_prompt=False, ignore_eos=True, seed=11,
                       **sampling(1.5)).text for _ in range(2)]
    finally:
        c.close()
    assert all(r.error is None and r.completion_tokens == 12 for r in got)
    assert same[0] == same[1] and got[0].text != got[1].text


def test_a_routing_the_running_server_does_not_do_is_refused(server, tmp_path, capsys):
    rc = main(["bench", "sweep", "--url", server, "--out", str(tmp_path), "--routing", "uniform"])
    assert rc != 0
    assert "start it with --expert-routing uniform" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was measured or written


def test_bench_help_lists_seed_and_routing(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--seed SEED" in out and "--routing {model,uniform}" in out


def test_a_uniform_run_says_its_peers_kept_their_routing():
    from strata.bench.report import markdown

    md = markdown({"name": "x", "date": "d", "routing": "uniform", "seed": 3, "temperature": 0,
                   "peers": {"llamacpp": {"how": "llama.cpp server", "routing": "model", "suites": {}}}})
    assert "llamacpp ran with its model's routing" in md and "greedy: the seed changes nothing" in md


@pytest.mark.parametrize("flag,value,message", [("--temperature", "-0.5", "--temperature must be within 0..2, got -0.5"),
                                                ("--seed", "-1", "--seed must be >= 0, got -1")])
def test_bench_refuses_a_setting_out_of_range(tmp_path, capsys, flag, value, message):
    # checked before any server is asked: the URL here answers nothing
    rc = main(["bench", "sweep", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), flag, value])
    assert rc != 0
    assert message in capsys.readouterr().err


def test_the_report_says_how_decode_steps_ran_and_why():
    from strata.bench.report import markdown

    steps = {"graphs": True, "ahead": True, "misses": "staged", "launched_ahead": 40, "ahead_dropped": 1,
             "misses_why": "staged after the trials: best hand-off plan 000000000@16 23.00 ms a token",
             "chunk_buffer_loans": 3, "prefetch": {"on": False, "issued": 1200, "used": 70, "off_why": "..."}}
    md = markdown({"name": "x", "date": "d", "temperature": 0,
                   "server": {"url": "u", "phases": [{"suites": ["sweep"], "server": {"decode_steps": steps}}]}})
    assert "sweep: misses staged, graphs on, 40 launched ahead (1 dropped), chunk buffers borrowed back 3 times" in md
    assert "next-layer prefetch off (70 of 1200 prefetched experts used)" in md
    assert "- decode misses' path: staged after the trials: best hand-off plan" in md
    assert "allocator retries" not in md  # (not reported: a CPU server)
    steps.update(alloc_retries=212, captures_dropped=3, captures_no_room=1)
    md = markdown({"name": "x", "date": "d", "temperature": 0,
                   "server": {"url": "u", "phases": [{"suites": ["sweep"], "server": {"decode_steps": steps}}]}})
    assert ", allocator retries 212, captures dropped 3 / not fitting 1" in md


def test_a_cpu_server_reports_no_memory_pressure(hf_and_gguf):
    from strata.config import EngineConfig
    from strata.engine.engine import Engine
    from strata.engine.loader import load_model
    from strata.server.app import _decode_steps

    _, path = hf_and_gguf("qwen3moe")
    steps = _decode_steps(Engine(load_model(str(path), EngineConfig(device="cpu", dtype="float32")), n_slots=1))
    assert "alloc_retries" not in steps and steps["graphs"] is False


def test_the_report_gives_each_servers_vram_peak_against_the_budget():
    """Both servers are meant to run in one VRAM budget: each phase's measured peak is printed beside it, and a
    server that went past it (llama.cpp once took 19.67 GiB of a 16 GiB budget, its --n-cpu-moe fitted for less
    KV than it got) is named."""
    from strata.bench.report import markdown

    GiB = 2 ** 30
    md = markdown({"name": "x", "date": "d", "temperature": 0, "vram_budget_gib": 16,
                   "server": {"url": "u", "phases": [{"suites": ["sweep"], "vram_peak_bytes": int(15.85 * GiB)}]},
                   "peers": {"llamacpp": {"how": "llama-server", "suites": {},
                                          "phases": [{"suites": ["sweep"], "vram_peak_bytes": int(19.67 * GiB)}]}}})
    assert "- strata's VRAM peak: sweep 15.85 GiB (budget 16 GiB)\n" in md
    assert "VRAM peak: sweep 19.67 GiB (budget 16 GiB): **3.67 GiB over the budget**" in md
    # no budget (resident), no NVML (no GPU): nothing claimed
    md = markdown({"name": "x", "date": "d", "temperature": 0,
                   "server": {"url": "u", "phases": [{"suites": ["sweep"], "vram_peak_bytes": None}]}})
    assert "VRAM peak" not in md


def test_one_slot_baseline_starts_a_one_slot_server_for_one_worker(tiny, tmp_path):
    """--one-slot-baseline: after the concurrency phase on a slot per worker, a 1-slot server of the same engine
    serves one worker; results.md sets the many-slot server's 1-worker level against it."""
    rc = main(["bench", "concurrency", "-m", tiny, "--cpu-threads", "1", "--name", "slots", "--out", str(tmp_path),
               "--workers", "1,2", "--conc-prompt", "80", "--conc-gen", "3", "--conc-requests", "1",
               "--one-slot-baseline"])
    assert rc == 0
    out = next(tmp_path.iterdir())
    res = json.loads(out.joinpath("results.json").read_text())
    phases = res["server"]["phases"]
    assert [(p["suites"], p["parallel"]) for p in phases] == [(["concurrency"], 2), (["concurrency-1slot"], 1)]
    assert phases[0]["ctx"] == phases[1]["ctx"]
    one = res["suites"]["concurrency-1slot"]
    assert one["server_slots"] == 1 and [lv["workers"] for lv in one["levels"]] == [1]
    assert one["levels"][0]["errors"] == 0 and one["levels"][0]["aggregate_tok_s"] > 0
    md = out.joinpath("results.md").read_text()
    assert "One worker on a 1-slot server: " in md and "-slot server's." in md
    assert "on the 2-slot server" in md


def test_one_slot_baseline_needs_more_than_one_worker(tmp_path, capsys):
    rc = main(["bench", "concurrency", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--workers", "1",
               "--one-slot-baseline"])
    assert rc != 0
    assert "--one-slot-baseline needs the concurrency suite with more than one worker" in capsys.readouterr().err
