"""Prompt construction: exact sizes under a real tokenizer and chat template, a unique prefix per prompt, the
same filler for every prompt of a size."""

import pytest

from strata import StrataError
from strata.bench.prompts import PromptBuilder, filler_text, fmt_size, parse_size, parse_sizes, unique_line


@pytest.fixture(scope="module")
def chat_tokens(hf_and_gguf):
    """(count, ids) of one user message rendered with the tiny model's chat template and tokenized as the server
    does (strata's GGUF tokenizer, `encode_prompt`)."""
    from strata.gguf.chat_template import ChatTemplate
    from strata.gguf.reader import open_gguf
    from strata.gguf.tokenizer import Tokenizer

    _, path = hf_and_gguf("qwen3moe")
    meta = open_gguf(path).metadata
    tok, tmpl = Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)

    def ids(text: str) -> list[int]:
        return tok.encode_prompt(tmpl.render([{"role": "user", "content": text}], add_generation_prompt=True))

    calls = []

    def count(text: str) -> int:
        calls.append(len(text))
        return len(ids(text))

    count.calls = calls
    return count, ids


@pytest.mark.parametrize("target", [60, 100, 257, 1000, 3000])
def test_sizes_within_one_percent(chat_tokens, target):
    count, ids = chat_tokens
    b = PromptBuilder(count, tag="t")
    p = b.build(target)
    real = len(ids(p.text))  # an independent recount of the text that would be sent
    assert real == p.tokens
    assert abs(real - target) <= max(1, target // 100)
    assert p.text.startswith(p.first_line + "\n")


def test_sizes_are_exact_to_the_token_mostly(chat_tokens):
    """Cutting the filler by characters reaches the target itself, not just the 1% band."""
    count, ids = chat_tokens
    b = PromptBuilder(count, tag="t")
    exact = sum(len(ids(b.build(n).text)) == n for n in range(300, 320))
    assert exact >= 18


def test_offset_aims_the_counter_lower(chat_tokens):
    """An engine that counts 3 more tokens (a BOS the count route leaves out) gets prompts 3 shorter by the counter."""
    count, ids = chat_tokens
    p = PromptBuilder(count, tag="t").build(500, offset=3)
    assert abs(len(ids(p.text)) - 497) <= 5
    assert p.tokens == len(ids(p.text)) + 3 and p.target == 500


def test_every_prompt_has_its_own_first_line(chat_tokens):
    count, ids = chat_tokens
    b = PromptBuilder(count, tag="t")
    prompts = [b.build(200) for _ in range(12)]
    assert len({p.first_line for p in prompts}) == 12
    # the token streams part within the first line: no cache could reuse more than the template's preamble and
    # the line's fixed start
    before_nonce = len(ids(prompts[0].first_line.split(" ")[0]))  # up to "[t"
    longest = max(_common(ids(a.text), ids(c.text)) for a, c in zip(prompts, prompts[1:]))
    assert longest < before_nonce + 12
    # ... and the rest is the same filler: routing and drafts see the same content from run to run
    for p in prompts:
        body = p.text.split("\n", 1)[1]
        assert body == filler_text(len(body))


def test_body_wrapper_and_small_targets(chat_tokens):
    count, ids = chat_tokens
    b = PromptBuilder(count, tag="t")
    p = b.build(300, body=lambda text: text + "\n\nQuestion: what was said?")
    assert p.text.endswith("Question: what was said?")
    assert abs(len(ids(p.text)) - 300) <= 3
    with pytest.raises(StrataError, match="overhead"):
        b.build(5)


def test_few_counts_per_prompt(chat_tokens):
    """The counter is the server's route: a prompt takes a handful of calls, not a scan."""
    count, _ = chat_tokens
    b = PromptBuilder(count, tag="t")
    b.build(800)  # calibrates the rate
    count.calls.clear()
    b.build(2000)
    assert len(count.calls) <= 10


def test_filler_is_deterministic_prose():
    a, c = filler_text(5000), filler_text(5000)
    assert a == c and len(a) == 5000
    assert filler_text(5000, seed=1) != a
    words = a.split()
    assert len(set(words)) > 60  # not one phrase repeated
    assert a[:100] == filler_text(100)
    assert unique_line("x") != unique_line("x")


def test_sizes_parse():
    assert parse_size("4K") == 4096 and parse_size("32k") == 32768 and parse_size("1500") == 1500
    assert parse_sizes("1K, 4K,16K") == [1024, 4096, 16384]
    assert fmt_size(4096) == "4K" and fmt_size(1000) == "1000"
    for bad in ("x", "0", "-1K"):
        with pytest.raises(StrataError):
            parse_size(bad)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
