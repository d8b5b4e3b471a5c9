"""Hypothesis strategies for request bodies, built by introspecting the pydantic request models.

Nothing here names a request field (but the few whose cost must stay bounded): every field of every model, nested
models included, is found through `model_fields`, so a field added to strata/server/protocol.py is fuzzed the day
it lands. Each field is drawn from one of three families:

- plausible: a value of the declared type within its declared bounds (what a correct client sends),
- extreme: bounds +- 1, the edges of int64 / uint64, NaN and infinities, huge and empty strings and lists,
- wrong: any JSON value at all, nested, with unicode from every category (lone surrogates included).
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from typing import Any, Literal, Union

from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

MAX_DEPTH = 3
# fields whose plausible values decide how much a generation costs: kept tiny so a body is cheap to serve
CHEAP_TOKENS = {"max_tokens", "max_completion_tokens"}
MAX_CHEAP = 2
CHEAP = st.sampled_from([1, 1, 1, MAX_CHEAP])  # one token is one engine step (the prompt's); a second is a decode
MAX_OPTIONAL = 4  # optional fields per body: more finds no more, and drawing them is what a body costs

# every unicode category, surrogates (Cs) included: json.dumps spells a lone one as a \udXXX escape
_any_char = st.characters(codec=None, exclude_categories=())
_markup = st.sampled_from(["<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>", "<think>", "</think>",
                           "{{ messages }}", "{% for x in range(99999999) %}", "\x00", "\ud800", "\udfff",
                           "\U0001f600", "\u202e", "\ufeff", '{"name": "f", "arguments": {}}', "[TOOL_CALLS]"])
TEXT = st.one_of(st.text(max_size=8), st.text(_any_char, max_size=8), _markup,
                 st.tuples(_markup, st.text(max_size=4), _markup).map("".join))
EXTREME_TEXT = st.one_of(st.just(""), st.just("x" * 3000), st.just("\ud800" * 64), st.just("\\" * 100),
                         st.text(_any_char, min_size=200, max_size=400))
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT)
ANY_JSON = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3),
                        max_leaves=8)
DEEP = st.integers(50, 600).flatmap(lambda n: st.sampled_from([
    json.loads("[" * n + "]" * n),
    {"a": json.loads("[" * n + "]" * n)}]))


def _bounds(meta) -> dict:
    b = {}
    for m in meta:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            v = getattr(m, name, None)
            if v is not None:
                b[name] = v
    return b


def _int(b: dict) -> st.SearchStrategy:
    lo = b.get("ge", b["gt"] + 1 if "gt" in b else None)
    hi = b.get("le", b["lt"] - 1 if "lt" in b else None)
    base_lo = lo if lo is not None else -1000
    base_hi = hi if hi is not None else base_lo + 1000
    return st.integers(base_lo, max(base_lo, base_hi))


def _int_extremes(b: dict) -> st.SearchStrategy:
    edges = [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**40]
    for k in ("ge", "gt", "le", "lt"):
        if k in b:
            edges += [b[k] - 1, b[k], b[k] + 1]
    return st.sampled_from(edges) | st.sampled_from(edges).map(float)


def _float(b: dict) -> st.SearchStrategy:
    lo = b.get("ge", b.get("gt"))
    hi = b.get("le", b.get("lt"))
    return st.floats(min_value=lo, max_value=hi, exclude_min="gt" in b, exclude_max="lt" in b,
                     allow_nan=False, allow_infinity=False)


def _float_extremes(b: dict) -> st.SearchStrategy:
    edges = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1.7976931348623157e308, -1e308]
    for k in ("ge", "gt", "le", "lt"):
        if k in b:
            edges += [b[k] - 1e-9, b[k], b[k] + 1e-9]
    return st.sampled_from(edges)


def plausible(ann, meta=(), depth: int = 0, mode: str = "plausible") -> st.SearchStrategy:
    """A value a correct client could send for a field of this annotation (nested models in `mode`)."""
    b = _bounds(meta)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any or ann is object:
        return ANY_JSON if depth < MAX_DEPTH else _scalar
    if origin in (Union, types.UnionType):
        return st.one_of([plausible(a, meta, depth, mode) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if ann is type(None):
        return st.none()
    if ann is bool:
        return st.booleans()
    if ann is int:
        return _int(b)
    if ann is float:
        return _float(b)
    if ann is str:
        lo, hi = b.get("min_length", 0), b.get("max_length", 24)
        return TEXT.filter(lambda s: lo <= len(s) <= hi) if lo or "max_length" in b else TEXT
    if origin in (list, tuple, typing.Sequence, set):
        lo = b.get("min_length", 0)
        if depth >= MAX_DEPTH:
            return st.just([])
        return st.lists(plausible(args[0] if args else Any, (), depth + 1, mode), min_size=lo, max_size=max(lo, 2))
    if origin is dict:
        v = args[1] if len(args) > 1 else Any
        if depth >= MAX_DEPTH:
            return st.just({})
        return st.dictionaries(TEXT, plausible(v, (), depth + 1, mode), max_size=3)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return body(ann, mode, depth + 1) if depth < MAX_DEPTH else st.just({})
    return ANY_JSON  # an annotation this module does not know yet: still fuzzed, with anything


def extreme(ann, meta=()) -> st.SearchStrategy:
    """Edges of the declared type: just outside and just inside the bounds, and the edges of what JSON can spell."""
    b = _bounds(meta)
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (Union, types.UnionType):
        return st.one_of([extreme(a, meta) for a in args if a is not type(None)] or [st.none()])
    if ann is int:
        return _int_extremes(b)
    if ann is float:
        return _float_extremes(b)
    if ann is str or origin is Literal:
        return EXTREME_TEXT
    if origin in (list, tuple, set):
        return st.sampled_from([[], [None] * 200]) | st.lists(plausible(args[0] if args else Any, (), MAX_DEPTH - 1),
                                                              min_size=30, max_size=40)
    if origin is dict or (isinstance(ann, type) and issubclass(ann, BaseModel)):
        return st.sampled_from([{}, {"": None}, {"\ud800": "\udc00"}]) | DEEP
    return DEEP


def wrong() -> st.SearchStrategy:
    return ANY_JSON


def value(name: str, field, depth: int, mode: str) -> st.SearchStrategy:
    ann, meta = field.annotation, field.metadata
    ok = CHEAP if name in CHEAP_TOKENS else plausible(ann, meta, depth, mode)
    if mode == "plausible":
        return ok
    return st.one_of(ok, ok, ok, extreme(ann, meta), wrong())


@functools.lru_cache(maxsize=None)
def body(model: type[BaseModel], mode: str = "mixed", depth: int = 0) -> st.SearchStrategy:
    """A JSON object for this model: its required fields always there, a few of the optional ones (every one is
    picked as often as any other), unknown keys now and then. mode "plausible": every field plausible; "mixed": a
    field is plausible, extreme or wrong. (Built once per model: building strategies costs more than drawing.)"""
    required, optional = {}, {}
    for name, f in model.model_fields.items():
        (required if f.is_required() else optional)[f.alias or name] = value(name, f, depth, mode)
    keys = sorted(optional)
    most = MAX_OPTIONAL if depth == 0 else 2

    @st.composite
    def draw_body(draw):
        out = {}
        if depth == 0 and draw(st.integers(0, 7)) == 0:
            out.update(draw(st.dictionaries(TEXT, ANY_JSON, max_size=2)))
        for k in (draw(st.lists(st.sampled_from(keys), max_size=most, unique=True)) if keys else ()):
            out[k] = draw(optional[k])
        for k, strat in required.items():
            out[k] = draw(strat)
        return out

    if mode == "plausible" and depth > 0 and model.__pydantic_decorators__.model_validators:
        # a rule of the model across its fields (a message's content may be left out only with tool calls) is not
        # in the fields' types: plausible bodies keep to it, as a correct client does
        return draw_body().filter(functools.partial(_validates, model))
    return draw_body()


def _validates(model: type[BaseModel], b: dict) -> bool:
    try:
        model.model_validate(b)
        return True
    except ValidationError:
        return False


def request(model: type[BaseModel], mode: str, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A top-level body whose fields named in `overrides` (by field name) are drawn from those strategies."""
    keys = {name: f.alias or name for name, f in model.model_fields.items()}

    def apply(b: dict, drawn: dict) -> dict:
        for name, v in drawn.items():
            if keys[name] in b:
                b[keys[name]] = v
        return b

    return st.builds(apply, body(model, mode), st.fixed_dictionaries(overrides))


def cheapen(b: Any, generates: bool) -> Any:
    """A body that would be served in full generates at most a few tokens: without max_tokens (or with -1, or more
    than the context leaves: generation stops at its end) a request may generate a context's worth. (Only an int
    is a max_tokens: the models are strict, "50" and 50.0 are 400s.)"""
    if not generates or not isinstance(b, dict):
        return b
    present = [k for k in CHEAP_TOKENS if b.get(k) is not None]
    if not present:
        b["max_tokens"] = MAX_CHEAP
    for k in present:
        v = b[k]
        if isinstance(v, int) and not isinstance(v, bool) and (v > MAX_CHEAP or v == -1):
            b[k] = MAX_CHEAP
    return b
