"""A bench run's outputs: raw JSON, a Markdown report, PNG plots (matplotlib), all in one directory.

`results.json` holds everything measured (every request's timings included) plus the machine, model and flags;
`results.md` the tables a reader wants, every number with its spread and, where a peer ran, as a ratio to it;
`sweep.png`, `concurrency.png`, `needle.png` the same as plots.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from strata.bench.client import sampling_text
from strata.bench.outdir import write_text
from strata.bench.prompts import fmt_size
from strata.bench.stats import Summary, ratio

FORMAT, VERSION = "strata-bench", 1


# ---------------------------------------------------------------------------------------------------------------
# ratios


def sweep_rows(suite: dict | None) -> dict[int, dict]:
    return {r["length"]: r for r in (suite or {}).get("rows", [])}


def sweep_ratios(ours: dict | None, peer: dict | None) -> list[dict]:
    """strata / peer per prompt length both measured: prefill and decode tok/s (higher is better for strata),
    TTFT peer / strata (so that > 1 also means strata is better)."""
    a, b = sweep_rows(ours), sweep_rows(peer)
    out = []
    for n in sorted(set(a) & set(b)):
        med = lambda row, k: (row.get(k) or {}).get("median")  # noqa: E731
        out.append({"length": n,
                    "prefill": ratio(med(a[n], "prefill_tok_s"), med(b[n], "prefill_tok_s")),
                    "decode": ratio(med(a[n], "decode_tok_s"), med(b[n], "decode_tok_s")),
                    "ttft": ratio(med(b[n], "ttft_s"), med(a[n], "ttft_s"))})
    return out


def concurrency_ratios(ours: dict | None, peer: dict | None) -> list[dict]:
    a = {lv["workers"]: lv for lv in (ours or {}).get("levels", [])}
    b = {lv["workers"]: lv for lv in (peer or {}).get("levels", [])}
    return [{"workers": w, "aggregate": ratio(a[w]["aggregate_tok_s"], b[w]["aggregate_tok_s"]),
             "latency_p50": ratio(b[w]["latency_s"]["p50"], a[w]["latency_s"]["p50"])}
            for w in sorted(set(a) & set(b))]


def peer_ratios(results: dict) -> dict:
    """Every peer's ratios against strata's suites of the same run."""
    ours = results.get("suites", {})
    out = {}
    for name, peer in (results.get("peers") or {}).items():
        ps = peer.get("suites") or {}
        out[name] = {"sweep": sweep_ratios(ours.get("sweep"), ps.get("sweep")),
                     "concurrency": concurrency_ratios(ours.get("concurrency"), ps.get("concurrency"))}
    return out


# ---------------------------------------------------------------------------------------------------------------
# markdown


def _s(d: dict | None, digits: int = 1) -> str:
    if not d or d.get("median") is None:
        return "-"
    return Summary(**d).fmt(digits)


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


# the sweep table's expert columns: hits, CPU and PCIe experts per token
EXPERT_COLUMNS = ("hit_rate", "cpu_per_token", "pcie_per_token")


def _sweep_md(s: dict) -> list[str]:
    c = s["config"]
    if c.get("tool") == "llama-bench":
        head = (f"llama-bench: prefill = `pp L`, decode = `tg {c['gen']}` at depth L, {c['runs']} repetitions after its "
                "warm-up; median (min-max) of the repetitions.")
    elif c.get("tool") == "hf_offload":
        head = (f"transformers: one forward over exactly L prompt tokens, then {c['gen']} greedy steps with the KV "
                f"cache, {c['warmup']} warm-up + {c['runs']} measured passes; TTFT = the prefill forward.")
    else:
        head = (f"Uncached prompts (unique first line, `cache_prompt: false`), {c['warmup']} warm-up + {c['runs']} "
                f"measured runs per length, {c['gen']} generated tokens, "
                f"{sampling_text(c.get('temperature', 0), c.get('seed', 0))}; "
                "median (min-max). Prefill and decode from the "
                "engine's timings, TTFT from the client's clock.")
    lines = [head]
    rows = []
    for r in s["rows"]:
        ex = r.get("experts") or {}
        rows.append([fmt_size(r["length"]), ",".join(str(t) for t in r["prompt_tokens"]), _s(r["prefill_tok_s"]),
                     _s(r["decode_tok_s"]), _s(r["ttft_s"], 3), _pct(ex.get("hit_rate")),
                     _f(ex.get("cpu_per_token"), "{:.1f}"), _f(ex.get("pcie_per_token"), "{:.1f}")])
    lines += _table(["prompt", "tokens", "prefill tok/s", "decode tok/s", "TTFT s", "expert hits", "CPU exp/tok",
                     "PCIe exp/tok"], rows)
    told = False  # the cumulative statistics' footnote, said once
    for r in s["rows"]:
        kw = r.get("kv_window")
        if kw and kw.get("hit_rate") is not None:
            lines.append(f"\nKV window at {fmt_size(r['length'])}: {_pct(kw['hit_rate'])} of the KV pages read from "
                         f"VRAM, {kw['miss_bytes'] / 1e9:.2f} GB from host RAM")
        if r.get("note"):
            lines.append(f"\nNote ({fmt_size(r['length'])}): {r['note']}")
        ex = r.get("experts") or {}
        # (a server without tiered experts reports no rates, and its empty statistics come marked cumulative all
        # the same: the columns show "-", which a footnote would only confuse)
        if not told and ex.get("cumulative") and any(ex.get(k) is not None for k in EXPERT_COLUMNS):
            lines.append(f"\nExpert statistics at {fmt_size(r['length'])} are cumulative since the server started "
                         "(it reports no raw counts).")
            told = True
    for sk in s.get("skipped", []):
        lines.append(f"\nSkipped {fmt_size(sk['length'])}: {sk['why']}")
    return lines


def _conc_md(s: dict) -> list[str]:
    c = s["config"]
    lines = [f"{c['requests_per_worker']} requests per worker back to back, {c['prompt_tokens']}-token uncached "
             f"prompts, {c['gen']} generated tokens, {sampling_text(c.get('temperature', 0), c.get('seed', 0))}"
             f"{' (worker i: seed + i)' if c.get('temperature') else ''}; server slots: "
             f"{s.get('server_slots')}."]
    rows = [[str(lv["workers"]), str(lv["requests"]), f"{lv['aggregate_tok_s']:.1f}", _f(lv["latency_s"]["p50"]),
             _f(lv["latency_s"]["p90"]), _f(lv["ttft_s"]["p50"], "{:.3f}"), _f(lv["ttft_s"]["p90"], "{:.3f}"),
             str(lv["errors"])] for lv in s["levels"]]
    return lines + _table(["workers", "requests", "aggregate tok/s", "latency p50 s", "p90 s", "TTFT p50 s",
                           "TTFT p90 s", "errors"], rows)


def _one_slot_md(suites: dict) -> list[str]:
    """--one-slot-baseline: the many-slot server's one worker against one worker on a 1-slot server."""
    from strata.bench.cli import ONE_SLOT

    conc, one = suites.get("concurrency") or {}, suites.get(ONE_SLOT) or {}
    a = next((lv for lv in conc.get("levels", []) if lv["workers"] == 1), None)
    b = next(iter(one.get("levels", [])), None)
    if a is None or b is None:
        return []
    return ["", f"One worker on a 1-slot server: {b['aggregate_tok_s']:.1f} tok/s (latency p50 "
                f"{_f(b['latency_s']['p50'])} s, TTFT p50 {_f(b['ttft_s']['p50'], '{:.3f}')} s); on the "
                f"{conc.get('server_slots')}-slot server {a['aggregate_tok_s']:.1f}: "
                f"**{_f(ratio(a['aggregate_tok_s'], b['aggregate_tok_s']))}x** of the 1-slot server's."]


def _needle_md(s: dict) -> list[str]:
    depths = s["config"]["depths"]
    grid: dict[int, dict[int, bool]] = {}
    for c in s["cells"]:
        grid.setdefault(c["length"], {})[c["depth"]] = c["recalled"]
    rows = [[fmt_size(n)] + ["found" if grid[n].get(d) else "missed" for d in depths] for n in sorted(grid)]
    lines = _table(["prompt"] + [f"{d}%" for d in depths], rows)
    lines.append(f"\nRecall {_pct(s['recall'])}. Note: {s['note']}.")
    return lines


def _sanity_md(s: dict) -> list[str]:
    lines = [f"{s['passed']}/{s['total']} passed (case set {s['fingerprint']}): " +
             ", ".join(f"{k} {v['passed']}/{v['total']}" for k, v in s["by_kind"].items())]
    rows = [[c["id"], c["kind"], "pass" if c["passed"] else "fail",
             "`" + (json.dumps(c["tool_calls"]) if c["tool_calls"] else c["answer"]).replace("|", "\\|")
             .replace("\n", " ")[:60] + "`"] for c in s["cases"]]
    lines += _table(["case", "kind", "result", "answer"], rows)
    if "compare" in s:
        c = s["compare"]
        lines.append(f"\nAgainst the baseline: regressed {c['regressed'] or 'none'}, fixed {c['fixed'] or 'none'}, "
                     f"answers changed {c['changed'] or 'none'}.")
    return lines


def _profiles(srv: dict) -> list[dict]:
    out = [srv["profile"]] if srv.get("profile") else []
    return out + [ph["server"]["profile"] for ph in srv.get("phases", []) if (ph.get("server") or {}).get("profile")]


def _pressure_note(d: dict) -> str:
    """The server's signs of a tight budget (a CUDA server reports them; absent: not measured)."""
    if d.get("alloc_retries") is None:
        return ""
    out = f", allocator retries {d['alloc_retries']}"
    if d.get("captures_dropped") or d.get("captures_no_room"):
        out += f", captures dropped {d.get('captures_dropped', 0)} / not fitting {d.get('captures_no_room', 0)}"
    return out


def _prefetch_note(p: dict | None) -> str:
    """The next-layer prefetch's part of the decode-steps line: what it copied ahead and its layer used."""
    if not p:
        return ""
    used = f"{p['used']} of {p['issued']} prefetched experts used" if p.get("issued") else "nothing prefetched"
    return f", next-layer prefetch {'on' if p.get('on') else 'off'} ({used})"


def _requests_line(results: dict) -> str:
    """The header's line on what the timed requests drew from: temperature, seed, and the experts' routing."""
    t, seed = results.get("temperature") or 0, results.get("seed", 0)
    how = f"temperature {t:g}, sampled" if t else "temperature 0 (greedy: the seed changes nothing)"
    routing = results.get("routing")
    if routing == "uniform":
        route = ("**uniform** (`--expert-routing uniform`: each token to k random experts, the expert cache's worst "
                 "case; the text is not the model's, the numbers are speed only)")
    elif routing == "model":
        route = "the model's router"
    else:
        route = "not reported by the server"
    return (f"- sweep and concurrency requests: {how}, seed {seed} (concurrency worker i: seed {seed} + i); "
            f"strata's expert routing: {route}")


def _vram_line(phases: list[dict], budget_gib: float | None) -> str | None:
    """Each phase's VRAM peak (NVML: the GPU's use above its idle baseline while that server ran) against the
    budget both servers were given: a peer fitted past it is named, since its numbers then had more VRAM."""
    peaks = [("+".join(ph.get("suites") or []), ph["vram_peak_bytes"]) for ph in phases if ph.get("vram_peak_bytes")]
    if not peaks:
        return None
    line = "VRAM peak: " + ", ".join(f"{name} {b / 2**30:.2f} GiB" for name, b in peaks)
    if budget_gib:
        line += f" (budget {budget_gib:g} GiB)"
        over = max(b for _, b in peaks) / 2**30 - budget_gib
        if over > 0.02 * budget_gib:  # (the poll's own noise aside)
            line += f": **{over:.2f} GiB over the budget**"
    return line


def markdown(results: dict) -> str:
    m, mod, srv = results.get("machine", {}), results.get("model", {}), results.get("server", {})
    chk = m.get("check", {})
    gpus = ", ".join(f"{g['name']} ({g['vram_total'] / 2**30:.0f} GiB, PCIe gen {g.get('pcie_gen')} x{g.get('pcie_width')})"
                     for g in chk.get("gpus", [])) or f"none ({chk.get('gpu_note')})"
    cpu = chk.get("cpu", {})
    lines = [f"# strata bench: {results['name']} ({results['date']})", "",
             f"- command: `{' '.join(results.get('command', []))}`",
             f"- machine: {cpu.get('model')} ({cpu.get('cores_physical')} cores), RAM "
             f"{chk.get('ram_total', 0) / 2**30:.0f} GiB, GPU: {gpus}; torch {m.get('torch')}, strata "
             f"{m.get('strata')} ({m.get('commit')})"]
    if mod:
        fp = mod.get("footprint") or {}
        lines.append(f"- model: {mod.get('name') or mod.get('path')} ({mod.get('path')}), "
                     f"{_bytes(fp.get('total_bytes'))} = dense {_bytes(fp.get('dense_bytes'))} + "
                     f"experts {_bytes(fp.get('expert_bytes'))}; {fp.get('n_moe_layers')} MoE layers x "
                     f"{fp.get('n_expert')} experts, top-{fp.get('n_expert_used')}"
                     + ("; **synthetic weights: speed only, never quality**" if mod.get("synthetic") else ""))
        if fp.get("n_expert"):
            e = fp["n_moe_layers"] * fp["n_expert_used"] * fp["slot_bytes"]
            lines.append(f"- roofline inputs per token at batch 1 (BENCH.md): routed expert bytes E = {_bytes(e)}, "
                         f"other weights D <= {_bytes(fp['dense_bytes'])} (plus the KV read)")
    lines.append(f"- server: {srv.get('url')} {'(started by the bench)' if srv.get('started') else '(already running)'}"
                 f"; flags: `{' '.join(srv.get('flags') or []) or '(defaults)'}`")
    if srv.get("settings"):
        lines.append(f"- settings: {json.dumps(srv['settings'], sort_keys=True)}")
    steps = [(ph.get("suites"), (ph.get("server") or {}).get("decode_steps")) for ph in srv.get("phases", [])]
    steps = [(names, d) for names, d in steps if d]
    if steps:
        lines.append("- decode steps: " + "; ".join(
            f"{'+'.join(names or [])}: misses {d.get('misses') or '-'}, graphs {'on' if d.get('graphs') else 'off'}, "
            f"{d.get('launched_ahead', 0)} launched ahead ({d.get('ahead_dropped', 0)} dropped)"
            + (f", chunk buffers borrowed back {d['chunk_buffer_loans']} times"
               f" ({d.get('chunk_buffer_borrow_ms', 0):.1f} ms in all)" if d.get("chunk_buffer_loans")
               is not None else "") + _prefetch_note(d.get("prefetch")) + _pressure_note(d) for names, d in steps))
        whys = {d["misses_why"] for _, d in steps if d.get("misses_why")}
        for why in sorted(whys):  # why the misses took that path (the plan trials' verdict)
            lines.append(f"- decode misses' path: {why}")
    budget = results.get("vram_budget_gib")
    vram = _vram_line(srv.get("phases") or ([srv] if srv.get("vram_peak_bytes") else []), budget)
    if vram:
        lines.append(f"- strata's {vram}")
    lines.append(_requests_line(results))
    for prof in _profiles(srv):
        lines += ["", f"Per-token time breakdown ({prof.get('tokens')} tokens, the server's --profile):", ""]
        lines += _table(["bucket", "ms/token"], [[k, f"{v:.3f}"] for k, v in (prof.get("ms_per_token") or {}).items()])
    suites = results.get("suites", {})
    for key, title, fn in (("sweep", "Prefill / decode sweep", _sweep_md), ("concurrency", "Concurrency", _conc_md),
                           ("needle", "Needle in a haystack", _needle_md), ("sanity", "Sanity", _sanity_md)):
        if key in suites:
            lines += ["", f"## {title}", "", *fn(suites[key])]
            if key == "concurrency":
                lines += _one_slot_md(suites)
    peers = results.get("peers") or {}
    if peers:
        lines += ["", "## Peers (same run, same model file, same VRAM budget)"]
        ratios = results.get("ratios") or {}
        for name, p in peers.items():
            lines += ["", f"### {name}", "", f"{p.get('how', '')}"]
            vram = _vram_line(p.get("phases") or [], budget)
            if vram:
                lines += ["", vram]
            if results.get("routing") == "uniform":
                lines.append(f"\n{name} ran with its model's routing (it has no uniform override): its rows and the "
                             "ratios below set strata's worst case against the peer's ordinary routing.")
            if p.get("error"):
                lines.append(f"\n**not measured**: {p['error']}")
                continue
            ps = p.get("suites") or {}
            if "sweep" in ps:
                lines += ["", *_sweep_md(ps["sweep"])]
            if "concurrency" in ps:
                lines += ["", *_conc_md(ps["concurrency"]), *_one_slot_md(ps)]
            r = ratios.get(name) or {}
            if r.get("sweep"):
                lines += ["", f"strata / {name} (> 1: strata is faster; TTFT as {name} / strata):", ""]
                lines += _table(["prompt", "prefill", "decode", "TTFT"],
                                [[fmt_size(x["length"]), _f(x["prefill"]), _f(x["decode"]), _f(x["ttft"])]
                                 for x in r["sweep"]])
            if r.get("concurrency"):
                lines += ["", ""] + _table(["workers", "aggregate tok/s ratio", "latency p50 ratio"],
                                           [[str(x["workers"]), _f(x["aggregate"]), _f(x["latency_p50"])]
                                            for x in r["concurrency"]])
    if results.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in results["plots"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# plots


def _series(suite: dict | None, key: str):
    rows = (suite or {}).get("rows", [])
    xs = [r["length"] for r in rows if (r.get(key) or {}).get("n")]
    med = [r[key]["median"] for r in rows if (r.get(key) or {}).get("n")]
    lo = [r[key]["median"] - r[key]["min"] for r in rows if (r.get(key) or {}).get("n")]
    hi = [r[key]["max"] - r[key]["median"] for r in rows if (r.get(key) or {}).get("n")]
    return xs, med, [lo, hi]


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    suites = results.get("suites", {})
    peers = {n: (p.get("suites") or {}) for n, p in (results.get("peers") or {}).items() if not p.get("error")}
    title = f"{results['name']} ({results['date']})"
    if "sweep" in suites or any("sweep" in p for p in peers.values()):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, key, label in zip(axes, ("prefill_tok_s", "decode_tok_s", "ttft_s"),
                                  ("prefill tok/s", "decode tok/s", "time to first token (s)")):
            seen = []
            for name, suite in [("strata", suites.get("sweep"))] + [(n, p.get("sweep")) for n, p in peers.items()]:
                xs, ys, err = _series(suite, key)
                if xs:
                    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
                    seen += [y for y in ys if y > 0]
            if seen and max(seen) > 20 * min(seen):  # peers an order of magnitude apart: keep both readable
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["length"] for r in (suites.get("sweep") or {}).get("rows", [])})
            if ticks:
                ax.set_xticks(ticks, [fmt_size(t) for t in ticks])
                ax.minorticks_off()
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"sweep: {title} - median, bars min-max")
        fig.tight_layout()
        made.append(out / "sweep.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    if "concurrency" in suites:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, suite in [("strata", suites.get("concurrency"))] + [(n, p.get("concurrency")) for n, p in peers.items()]:
            lv = (suite or {}).get("levels", [])
            if not lv:
                continue
            w = [x["workers"] for x in lv]
            a1.plot(w, [x["aggregate_tok_s"] for x in lv], marker="o", label=name)
            a2.plot(w, [x["latency_s"]["p50"] for x in lv], marker="o", label=f"{name} p50")
            a2.plot(w, [x["latency_s"]["p90"] for x in lv], marker="x", linestyle="--", label=f"{name} p90")
        ws = [x["workers"] for x in (suites.get("concurrency") or {}).get("levels", [])]
        for ax, lab in ((a1, "aggregate generated tok/s"), (a2, "request latency (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ws, [str(w) for w in ws])
            ax.minorticks_off()
            ax.set_xlabel("concurrent workers")
            ax.set_ylabel(lab)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"concurrency: {title}")
        fig.tight_layout()
        made.append(out / "concurrency.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    if "needle" in suites and suites["needle"]["cells"]:
        s = suites["needle"]
        lengths = sorted({c["length"] for c in s["cells"]})
        depths = s["config"]["depths"]
        grid = [[math.nan] * len(depths) for _ in lengths]
        for c in s["cells"]:
            grid[lengths.index(c["length"])][depths.index(c["depth"])] = 1.0 if c["recalled"] else 0.0
        fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(depths), 1.4 + 0.6 * len(lengths)))
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_yticks(range(len(lengths)), [fmt_size(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("prompt tokens")
        ax.set_title("needle recall" + (" (synthetic weights: meaningless)" if s.get("synthetic") else ""),
                     fontsize=9)
        fig.tight_layout()
        made.append(out / "needle.png")
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


# ---------------------------------------------------------------------------------------------------------------


def _clean(x):
    """JSON without NaN (which is not JSON): NaN and inf become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(results: dict, out: Path) -> dict[str, Path]:
    """Write results.json, the plots and results.md into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    results = {"format": FORMAT, "version": VERSION, **results}
    results["ratios"] = peer_ratios(results)
    made = plots(results, out)
    results["plots"] = [p.name for p in made]
    js = out / "results.json"
    write_text(js, json.dumps(_clean(results), indent=1, default=str))
    md = out / "results.md"
    write_text(md, markdown(_clean(results)))
    return {"json": js, "markdown": md, **{p.stem: p for p in made}}
