"""Needle in a haystack: a code word hidden at 10/50/90% depth of a long prompt, asked for at the end.

Recall is the share of (length, depth) cells whose greedy answer contains the code word. It measures whether
long-context attention (and whatever KV handling an optimisation changes) still finds the needle, which only
a trained model can do: on synthetic weights the numbers are meaningless, and the result says so.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from strata.bench.client import BenchClient
from strata.bench.prompts import PromptBuilder, fmt_size
from strata.bench.sweep import check_reply, server_ctx

QUESTION = "\n\nQuestion: what is the secret code word mentioned in the notes above? Reply with the code word only."
_CODES = ("saffron", "obsidian", "marigold", "tungsten", "juniper", "cobalt", "lavender", "granite", "zephyr",
          "quartz", "hibiscus", "mahogany")
SYNTHETIC_NOTE = ("the model's weights are synthetic: recall means nothing here (it only measures something on a "
                  "trained model)")
UNKNOWN_NOTE = "recall only means something on a trained model"


@dataclass
class NeedleConfig:
    lengths: tuple[int, ...] = (4096, 16384)
    depths: tuple[int, ...] = (10, 50, 90)  # percent of the haystack before the needle
    gen: int = 16
    tolerance: float = 0.02


def code_word(length: int, depth: int) -> str:
    rng = random.Random(length * 1000 + depth)
    return f"{rng.choice(_CODES)}-{rng.randint(1000, 9999)}"


def haystack(code: str, depth: int) -> Callable[[str], str]:
    """body(text): the filler with the needle sentence at `depth`% (at the next sentence end), then the question."""
    def body(text: str) -> str:
        at = int(len(text) * depth / 100)
        if 0 < at < len(text):
            nxt = text.find(". ", at)
            at = nxt + 2 if nxt >= 0 else len(text)
        needle = f"The secret code word is {code}. Remember it. "
        return text[:at] + needle + text[at:] + QUESTION

    return body


def recalled(answer: str, code: str) -> bool:
    return code.lower() in answer.lower()


def run_needle(client: BenchClient, cfg: NeedleConfig, synthetic: bool | None = None,
               say: Callable[[str], None] = print, tag: str = "needle") -> dict:
    builder = PromptBuilder(client.count_tokens, tag=tag, tolerance=cfg.tolerance)
    ctx = server_ctx(client)
    cells, skipped = [], []
    for length in cfg.lengths:
        if ctx and length + cfg.gen > ctx:
            skipped.append({"length": length, "why": f"exceeds the context of {ctx}"})
            continue
        for depth in cfg.depths:
            code = code_word(length, depth)
            p = builder.build(length, body=haystack(code, depth))
            rep = client.chat([{"role": "user", "content": p.text}], cfg.gen, cache_prompt=False,
                              chat_template_kwargs={"enable_thinking": False})
            check_reply(rep, f"needle {fmt_size(length)} @ {depth}%")
            answer = rep.text.strip()
            ok = recalled(answer, code)
            cells.append({"length": length, "depth": depth, "code": code, "answer": answer[:200], "recalled": ok,
                          "prompt_tokens": rep.prompt_tokens, "prefill_tok_s": rep.prefill_tok_s})
            say(f"needle {fmt_size(length)} @ {depth}%: {'found' if ok else 'missed'} ({answer[:40]!r})")
    recall = sum(c["recalled"] for c in cells) / len(cells) if cells else None
    note = SYNTHETIC_NOTE if synthetic else UNKNOWN_NOTE
    if synthetic:
        say(f"needle: {note}")
    return {"config": {"lengths": list(cfg.lengths), "depths": list(cfg.depths), "gen": cfg.gen},
            "cells": cells, "skipped": skipped, "recall": recall, "synthetic": synthetic, "note": note}
