"""Logits processors for the engine's sampler path: OpenAI's `logit_bias` and grammar-constrained output
(JSON schema for `response_format` / llama.cpp's `json_schema`, llama.cpp's GBNF `grammar`, tool-call grammars
for `tool_choice` required/named) through llguidance.

llguidance is optional: without it, output is not constrained (a forced tool call or a JSON response is only
asked for, and parsed afterwards), and /props and /v1/models say so ("structured_output").
"""

from __future__ import annotations

import json
import threading

import torch

from strata.server.protocol import bad_request

try:  # optional dependency
    import llguidance
    import llguidance.torch as _lt
except ImportError:  # pragma: no cover - depends on the environment
    llguidance = None


_SHIFTS = torch.arange(32, dtype=torch.int32)


def constrained_available() -> bool:
    return llguidance is not None


def bias_processor(bias: dict[str, float], vocab_size: int, device) -> "callable":
    """OpenAI logit_bias: {token id (as a string): -100..100} added to the logits; -100 bans, 100 forces."""
    vec = torch.zeros(vocab_size, dtype=torch.float32)
    for k, v in bias.items():
        try:
            i = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias: key {k!r} is not a token id") from None
        if not 0 <= i < vocab_size:
            raise bad_request(f"logit_bias: token id {i} is outside the vocabulary (0..{vocab_size - 1})")
        if not -100 <= float(v) <= 100:
            raise bad_request(f"logit_bias: value for token {i} must be between -100 and 100")
        vec[i] = float(v)
    vec = vec.to(device)
    return lambda row: row.float() + vec  # [V]


def _cause(err: str, limit: int = 600) -> str:
    """An error text of several lines as one: the reason often comes on a later line (a regex error's first line
    is only "regex parse error:"). Caret lines, which point into a quoted line above, mean nothing once joined."""
    lines = [ln.strip() for ln in err.splitlines()]
    text = " ".join(ln for ln in lines if ln and set(ln) - set("^~ "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Wrapped:
    """The vocabulary as llguidance wants it: token bytes, control tokens marked with a 0xFF prefix."""

    def __init__(self, tok):
        from strata.gguf.tokenizer import TokenType

        self.eos_token_id = min(tok.eot_ids) if tok.eot_ids else (tok.eos_id or 0)
        self.bos_token_id = tok.bos_id
        self.tokens = [(b"\xff" if tok.token_type(i) == TokenType.CONTROL else b"") + tok.token_bytes(i)
                       for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.special_ids)
        self._tok = tok

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


class Grammars:
    """Per-model llguidance state: the wrapped vocabulary (built once, lazily: ~1 s for a large vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tokenizer, vocab_size
        self._ll = None
        self._lock = threading.Lock()

    def _lltok(self):
        with self._lock:
            if self._ll is None:
                w = llguidance.TokenizerWrapper(_Wrapped(self.tok))
                self._ll = llguidance.LLTokenizer(w, n_vocab=self.vocab_size, eos_token=sorted(self.tok.eot_ids))
            return self._ll

    def literal(self, text: str) -> str:
        """A Lark literal for `text`: a control token of the vocabulary is written as that token."""
        from strata.gguf.tokenizer import TokenType

        i = self.tok.piece_to_id(text)
        if i is not None and self.tok.token_type(i) == TokenType.CONTROL:
            return f"<[{i}]>"
        return json.dumps(text, ensure_ascii=False)

    def json_schema(self, schema: dict) -> str:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        except (ValueError, TypeError, OverflowError) as e:  # a schema it cannot take (an integer past 64 bits...)
            raise bad_request(f"json_schema: {_cause(str(e)) or type(e).__name__}") from None

    def lark(self, src: str) -> str:
        return llguidance.LLMatcher.grammar_from_lark(src)

    def gbnf(self, src: str) -> str:
        """llama.cpp's `grammar` field: GBNF (`root ::= ...`), or llguidance's Lark, which it also reads."""
        try:
            from llguidance.gbnf_to_lark import any_to_lark
        except ImportError:  # pragma: no cover - an llguidance too old to read GBNF
            raise bad_request("grammar: this server's llguidance cannot read GBNF (upgrade llguidance)") from None
        try:
            lark = any_to_lark(src)
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions that name the problem
            raise bad_request(f"grammar: {_cause(str(e)) or type(e).__name__}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def processor(self, grammar: str, what: str = "the output grammar") -> "callable":
        """Check the grammar once (a bad one is a 400); returns a maker of fresh matchers, one per sequence (the
        choices of a request with n > 1 each follow their own tokens)."""
        ll = self._lltok()
        err = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if err and not err.startswith("WARNING"):
            raise bad_request(f"cannot build {what}: {_cause(err)}")
        return lambda: GrammarProcessor(llguidance.LLMatcher(ll, grammar, log_level=0), self.vocab_size)


class GrammarProcessor:
    """Masks every token the grammar does not allow next. Bound to a sequence (`bind`), it first feeds the
    matcher the tokens sampled since the last call (the engine appends them to `seq.output`)."""

    def __init__(self, matcher, vocab_size: int):
        self.m, self.vocab_size = matcher, vocab_size
        self.mask = _lt.allocate_token_bitmask(1, vocab_size)
        self.seq = None
        self._fed = 0
        self.failed = False

    def bind(self, seq) -> "GrammarProcessor":
        self.seq = seq
        return self

    def __call__(self, row: torch.Tensor) -> torch.Tensor:  # row [V]
        out = self.seq.output
        while self._fed < len(out):
            if not self.m.consume_token(out[self._fed]):
                self.failed = True
            self._fed += 1
        row = row.float().unsqueeze(0)  # [1, V]
        if self.failed or self.m.is_error():
            return row[0]  # the grammar gave up (should not happen): sample freely rather than stall
        _lt.fill_next_token_bitmask(self.m, self.mask)
        # unpack the bitmask [1, ceil(V/32)] int32 -> allowed [V] (llguidance's own helper is torch.compile'd,
        # which would compile on first use)
        bits = (self.mask[0].unsqueeze(-1) >> _SHIFTS) & 1  # [V/32, 32]
        allowed = bits.reshape(-1)[: self.vocab_size].bool().to(row.device)
        return row[0].masked_fill(~allowed, float("-inf"))


def chain(*procs):
    procs = [p for p in procs if p is not None]
    if not procs:
        return None
    if len(procs) == 1:
        return procs[0]

    def run(row):
        for p in procs:
            row = p(row)
        return row

    return run
