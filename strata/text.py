"""Text from outside strata (the command line, stdin, a request body) made safe for the tokenizer.

Python hands over bytes that are not UTF-8 as lone surrogates: argv and stdin decode them with surrogateescape
(b"\\xff" -> "\\udcff"), and JSON may spell one as a "\\ud800" escape. A lone surrogate is not a Unicode character,
so the first encoder that meets it (the tokenizer, a UTF-8 writer) raises. Each becomes U+FFFD instead, what a
browser's UTF-8 encoder and `bytes.decode(errors="replace")` make of such input.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_surrogates(s: str) -> str:
    """`s` with every lone surrogate replaced by U+FFFD (the same str when it holds none)."""
    return _SURROGATE.sub("\ufffd", s)
