"""Decoding a request body: JSON text -> Python values that every later stage can handle.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which is not a Unicode character: Python keeps it in a str,
and the first encoder that meets it (the tokenizer, a UTF-8 writer) raises. A browser's UTF-8 encoder replaces
such a code unit with U+FFFD; so does strata, once, here, so that a JavaScript client that cut a string in the
middle of an emoji still gets its answer.

A large body is decoded and validated on a worker thread, not on the event loop, where it would stall every other
client's stream for as long as it takes (a 25 MB list of token ids: seconds). A thread alone is not enough: the
json module's C scanner holds the GIL for a whole document, so the loop would wait all the same. For a large
body, numbers and objects go through Python-level hooks: the interpreter runs between values and hands the GIL
to the other threads every switch interval (at about twice the parse time, on a thread no one waits for). What
still holds the GIL at once is one scan of a long run of strings or literals, and pydantic's check of one long
list (some 0.1 s per 4 million ids).
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
from pydantic import BaseModel

from strata.server.protocol import bad_request, parse
from strata.text import replace_surrogates

# bodies up to this size are decoded on the loop: a thread's hand-off costs more than their parse (~1 ms)
LARGE_BODY = 256 * 1024

# a surrogate can only come from a \\uD800..\\uDFFF escape (UTF-8 input cannot encode one): most bodies skip the walk
_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


async def read_request(request, model: type[BaseModel]) -> Any:
    """The request's body as `model` (a 400 unless it is JSON of that shape); large ones off the event loop."""
    raw = await request.body()
    if len(raw) <= LARGE_BODY:
        return _validated(raw, model, False)
    return await anyio.to_thread.run_sync(_validated, raw, model, True)


def _validated(raw: bytes, model: type[BaseModel], cede: bool) -> Any:
    try:
        value = decode_json(raw, cede)
    except (ValueError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    return parse(model, value)


def _int(s: str) -> int:
    return int(s)


def _float(s: str) -> float:
    return float(s)


def _object(pairs: list) -> dict:
    return dict(pairs)  # (the last of repeated keys stands, as without the hook)


def decode_json(raw: bytes, cede: bool = False) -> Any:
    """The decoded body; ValueError (or RecursionError) if it is not JSON. `cede`: call Python for each number and
    object, so that other threads run during a long parse (the same values, two to three times slower)."""
    value = json.loads(raw, parse_int=_int, parse_float=_float, object_pairs_hook=_object) if cede else json.loads(raw)
    if _ESCAPE.search(raw):
        value = _replace_surrogates(value)
    return value


def _replace_surrogates(value: Any) -> Any:
    # iterative: json.loads accepts nesting as deep as the recursion limit, a recursive walk would not
    if isinstance(value, str):
        return replace_surrogates(value)
    root = [value]
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    node[i] = replace_surrogates(v)
                elif isinstance(v, (list, dict)):
                    stack.append(v)
        else:
            for k in list(node):
                v = node[k]
                if isinstance(v, str):
                    v = replace_surrogates(v)
                elif isinstance(v, (list, dict)):
                    stack.append(v)
                if isinstance(k, str) and replace_surrogates(k) != k:
                    del node[k]
                    k = replace_surrogates(k)
                node[k] = v
    return root[0]
