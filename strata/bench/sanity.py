"""A frozen set of instruction, retrieval and tool-call cases with exact-match checks.

Run it before and after a change (`strata bench sanity`, then `strata bench sanity --baseline OLD.json`): a
case that passed and now fails is a quality regression; a greedy answer that changed at all is listed too,
which catches an optimisation that was meant to be exact (on synthetic weights no case passes, but the
answers still must not change). The cases never change: edit them and old baselines stop being comparable
(the set's fingerprint is recorded and compared).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from strata import StrataError
from strata.bench.client import BenchClient

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
CURRENCY = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount of money between currencies (ISO codes)",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "from": {"type": "string", "description": "ISO 4217 code, e.g. USD"},
        "to": {"type": "string", "description": "ISO 4217 code, e.g. EUR"}},
        "required": ["amount", "from", "to"]}}}

# id, kind, prompt, expected (answers accepted after normalisation, or the tool call), tools
CASES: list[dict] = [
    {"id": "echo-word", "kind": "instruction", "prompt": "Reply with exactly this word and nothing else: banana",
     "expect": ["banana"]},
    {"id": "arithmetic", "kind": "instruction", "prompt": "What is 17 + 25? Reply with the number only.",
     "expect": ["42"]},
    {"id": "reverse", "kind": "instruction", "prompt": "Write the word 'stressed' backwards. Reply with the result only.",
     "expect": ["desserts"]},
    {"id": "capital", "kind": "instruction", "prompt": "What is the capital of Japan? Reply with one word.",
     "expect": ["tokyo"]},
    {"id": "translate", "kind": "instruction", "prompt": "Translate 'thank you' into French. Reply with the translation "
     "only, no punctuation.", "expect": ["merci"]},
    {"id": "letters", "kind": "instruction", "prompt": "List the first three letters of the English alphabet in "
     "lowercase, separated by commas, without spaces. Reply with the list only.", "expect": ["a,b,c"]},
    {"id": "kv-lookup", "kind": "retrieval", "prompt": "Here is a table:\nalpha = 3\nbeta = 7\ngamma = 12\ndelta = 5\n"
     "epsilon = 9\n\nWhat is the value of gamma? Reply with the number only.", "expect": ["12"]},
    {"id": "fact-in-text", "kind": "retrieval", "prompt": "Read this note: 'The parcel for Maria Lopez was left at 14 "
     "Birch Street on Tuesday, after the courier found nobody home on Monday.'\nOn which day was the parcel left? "
     "Reply with the day only.", "expect": ["tuesday"]},
    {"id": "json-field", "kind": "retrieval", "prompt": 'Given the record {"id": 7, "owner": "kim", "status": "open", '
     '"priority": "high"}, what is the owner? Reply with the value only.', "expect": ["kim"]},
    {"id": "tool-weather", "kind": "tool", "prompt": "What is the weather in Paris right now?", "tools": [WEATHER],
     "expect_call": {"name": "get_weather", "arguments": {"city": "paris"}}},
    {"id": "tool-currency", "kind": "tool", "prompt": "Convert 100 US dollars to euros.", "tools": [WEATHER, CURRENCY],
     "expect_call": {"name": "convert_currency", "arguments": {"amount": 100, "from": "usd", "to": "eur"}}},
    {"id": "tool-choice", "kind": "tool", "prompt": "Use the right tool: how warm is it in Oslo today?",
     "tools": [CURRENCY, WEATHER], "expect_call": {"name": "get_weather", "arguments": {"city": "oslo"}}},
]
MAX_TOKENS = 48


def fingerprint(cases: list[dict] = CASES) -> str:
    return hashlib.sha256(json.dumps(cases, sort_keys=True).encode()).hexdigest()[:16]


def normalise(text: str) -> str:
    """Case, surrounding whitespace and quotes, and trailing punctuation do not count."""
    t = text.strip().strip("\"'`").strip().lower()
    return re.sub(r"[.!?;:]+$", "", t).strip()


def _norm_value(v):
    if isinstance(v, str):
        return v.strip().lower()
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    return v


def check_case(case: dict, text: str, calls: list[dict]) -> bool:
    """Exact match: the normalised answer is one of `expect`; or exactly one tool call with the expected name and
    arguments (strings compared case-insensitively, numbers numerically)."""
    if case["kind"] != "tool":
        return not calls and normalise(text) in case["expect"]
    want = case["expect_call"]
    if len(calls) != 1 or calls[0].get("name") != want["name"]:
        return False
    try:
        args = json.loads(calls[0].get("arguments") or "{}")
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    return {k: _norm_value(v) for k, v in args.items()} == {k: _norm_value(v) for k, v in want["arguments"].items()}


def run_sanity(client: BenchClient, baseline: dict | None = None, say: Callable[[str], None] = print,
               max_tokens: int = MAX_TOKENS) -> dict:
    results = []
    for case in CASES:
        try:
            rep = client.chat([{"role": "user", "content": case["prompt"]}], max_tokens, cache_prompt=False,
                              tools=case.get("tools"), chat_template_kwargs={"enable_thinking": False})
            error = rep.error
        except StrataError as e:  # e.g. a template without tools: the case fails, the set goes on
            rep, error = None, str(e)
        ok = error is None and check_case(case, rep.text, rep.tool_calls)
        results.append({"id": case["id"], "kind": case["kind"], "passed": ok, "answer": rep.text[:400] if rep else "",
                        "tool_calls": rep.tool_calls if rep else [], "finish_reason": rep.finish_reason if rep else None,
                        "error": error})
    passed = sum(r["passed"] for r in results)
    out = {"fingerprint": fingerprint(), "cases": results, "passed": passed, "total": len(results),
           "max_tokens": max_tokens}
    by_kind = {}
    for r in results:
        k = by_kind.setdefault(r["kind"], [0, 0])
        k[0] += r["passed"]
        k[1] += 1
    out["by_kind"] = {k: {"passed": v[0], "total": v[1]} for k, v in by_kind.items()}
    if baseline is not None:
        out["compare"] = compare(baseline, out)
    say(f"sanity: {passed}/{len(results)} passed (" +
        ", ".join(f"{k} {v['passed']}/{v['total']}" for k, v in out["by_kind"].items()) + ")")
    if "compare" in out:
        c = out["compare"]
        say(f"sanity vs baseline: {len(c['regressed'])} regressed, {len(c['fixed'])} fixed, "
            f"{len(c['changed'])} answers changed")
    return out


def compare(baseline: dict, now: dict) -> dict:
    """Per case: regressed (passed before, fails now), fixed, changed (a different answer or tool call)."""
    if baseline.get("fingerprint") != now.get("fingerprint"):
        raise StrataError(f"the sanity baseline was made with a different case set ({baseline.get('fingerprint')} vs "
                          f"{now.get('fingerprint')}): not comparable")
    if baseline.get("max_tokens", MAX_TOKENS) != now.get("max_tokens", MAX_TOKENS):
        raise StrataError(f"the sanity baseline allowed {baseline.get('max_tokens', MAX_TOKENS)} answer tokens, this run "
                          f"{now.get('max_tokens', MAX_TOKENS)}: not comparable")
    old = {c["id"]: c for c in baseline["cases"]}
    out = {"regressed": [], "fixed": [], "changed": []}
    for c in now["cases"]:
        b = old.get(c["id"])
        if b is None:
            continue
        if b["passed"] and not c["passed"]:
            out["regressed"].append(c["id"])
        if c["passed"] and not b["passed"]:
            out["fixed"].append(c["id"])
        if (b["answer"], b["tool_calls"]) != (c["answer"], c["tool_calls"]):
            out["changed"].append(c["id"])
    return out


def load_baseline(path: str | Path) -> dict:
    """A sanity result: a bench run's results.json (its sanity suite) or a saved sanity section."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StrataError(f"cannot read the sanity baseline {path}: {e}") from None
    if "suites" in data:
        data = (data.get("suites") or {}).get("sanity") or {}
    if "cases" not in data:
        raise StrataError(f"{path} holds no sanity results")
    return data
