"""Decoding a request body: JSON text -> Python values that every later stage can handle.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), which is not a Unicode character: Python keeps it in a str,
and the first encoder that meets it (the tokenizer, a UTF-8 writer) raises. A browser's UTF-8 encoder replaces
such a code unit with U+FFFD; so does strata, once, here, so that a JavaScript client that cut a string in the
middle of an emoji still gets its answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from strata.text import replace_surrogates

# a surrogate can only come from a \\uD800..\\uDFFF escape (UTF-8 input cannot encode one): most bodies skip the walk
_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def decode_json(raw: bytes) -> Any:
    """The decoded body; ValueError (or RecursionError) if it is not JSON."""
    value = json.loads(raw)
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
