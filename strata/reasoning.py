"""Splitting a model's reasoning (`<think>…</think>`) from its answer, incrementally, as text streams in.

Text that might be the start of a tag is held back until the next piece decides it, so a tag split across
tokens is never shown to the client.
"""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Feed text pieces; get (reasoning, content) pieces back.

    `in_reasoning` starts true when the prompt already opened the block (templates that end the generation
    prompt with `<think>`). With `enabled=False` everything is content. Only a block at the start of the output
    counts: a `<think>` after answer text is answer text.
    """

    def __init__(self, enabled: bool = True, in_reasoning: bool = False, calls: bool = False):
        # (calls: this format's tool calls are in the answer text itself; the harmony splitter needs to know)
        self.enabled = enabled
        self.in_reasoning = enabled and in_reasoning
        self._buf = ""
        self._seen_content = False
        self._after_close = False  # drop the blank lines templates put between </think> and the answer
        self._r_started = False  # drop the newline after <think>

    def push(self, text: str) -> tuple[str, str]:
        if not self.enabled:
            return "", text
        self._buf += text
        r, c = [], []
        while self._buf:
            buf = self._buf
            if self.in_reasoning:
                i = buf.find(CLOSE)
                if i >= 0:
                    r.append(buf[:i])
                    self._buf = buf[i + len(CLOSE):]
                    self.in_reasoning, self._after_close = False, True
                    continue
                keep = partial_suffix(buf, CLOSE)
                r.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            if self._after_close:
                buf = buf.lstrip("\n")
                if not buf:
                    self._buf = ""
                    break
                self._after_close = False
            if not self._seen_content:
                s = buf.lstrip()
                if s.startswith(OPEN):
                    self._buf = s[len(OPEN):]
                    self.in_reasoning = True
                    continue
                if OPEN.startswith(s):  # may still become <think> (or is only whitespace so far): wait
                    self._buf = buf
                    break
            c.append(buf)
            self._seen_content = True
            self._buf = ""
        return self._reasoning("".join(r)), "".join(c)

    def _reasoning(self, r: str) -> str:
        if not self._r_started:
            r = r.lstrip("\n")
            self._r_started = bool(r)
        return r

    def flush(self) -> tuple[str, str]:
        """The end of the output: whatever is held back is released (an unclosed block stays reasoning)."""
        buf, self._buf = self._buf, ""
        if self.in_reasoning:
            return self._reasoning(buf), ""
        if self._after_close:
            buf = buf.lstrip("\n")
        return "", buf


class RunEnd:
    """A run of reasoning pieces without its trailing newlines (the one templates put before `</think>`): they are
    held back until more reasoning shows they were inside the run, and dropped where it ends (answer text, a tool
    call, the end of the output). The streamed pieces then concatenate to what the whole output gives."""

    def __init__(self):
        self._held = ""

    def reasoning(self, text: str) -> str:
        """The part of a reasoning piece that can be sent now."""
        text = self._held + text
        body = text.rstrip("\n")
        self._held = text[len(body):]
        return body

    def end(self) -> None:
        """The run has ended: the newlines held back were its last."""
        self._held = ""


def split_reasoning(text: str, enabled: bool = True, in_reasoning: bool = False) -> tuple[str, str]:
    """Non-streaming split of a whole output into (reasoning, content)."""
    s = ReasoningSplitter(enabled, in_reasoning)
    r1, c1 = s.push(text)
    r2, c2 = s.flush()
    return (r1 + r2).rstrip("\n"), (c1 + c2)


# gpt-oss's harmony format: the output is messages, each `<|channel|>NAME<|message|>BODY<|end|>`, later ones
# introduced by `<|start|>assistant`; the generation prompt ends with `<|start|>assistant`, so the first header
# comes straight away. `analysis` is the reasoning, `final` (and any other channel) the answer. A message whose
# header names a recipient `to=functions.NAME` (before or after its channel) is a tool call: its body is the
# arguments' JSON, ended by `<|call|>`.
H_MESSAGE, H_CHANNEL = "<|message|>", "<|channel|>"
H_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")
REASONING_CHANNELS = frozenset({"analysis"})
# a harmony tool call as the splitter hands it to the tool-call parser (strata.server.toolcalls, format
# "harmony"): HARMONY_CALL + NAME + "\n" + ARGUMENTS + HARMONY_CALL_END. Private-use characters: no model text
# contains them, so nothing the model writes can open or close such a block.
HARMONY_CALL, HARMONY_CALL_END = "\ue000", "\ue001"
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def uses_harmony(template: str | None) -> bool:
    """Whether a chat template writes the harmony format (gpt-oss)."""
    return bool(template) and H_CHANNEL in template and H_MESSAGE in template


class HarmonySplitter:
    """`ReasoningSplitter` for harmony output: (reasoning, content) pieces, the message headers and ends
    dropped. Output that does not start with a header (`<|channel|>`, `<|start|>` or a recipient `to=`) is all
    content. With `enabled=False` everything (markers included) is content. With `calls` (the request offers
    tools), a message to `functions.NAME` goes to the content as a HARMONY_CALL block for the tool-call parser."""

    def __init__(self, enabled: bool = True, in_reasoning: bool = False, calls: bool = False):
        self.enabled = enabled
        self.calls = calls
        self._buf = ""
        self._mode = "header"  # header | body | plain
        self._channel = ""
        self._call = False  # the current message is a tool call

    def push(self, text: str) -> tuple[str, str]:
        if not self.enabled:
            return "", text
        self._buf += text
        r, c = [], []
        while self._buf:
            buf = self._buf
            if self._mode == "plain":
                c.append(buf)
                self._buf = ""
                break
            if self._mode == "header":
                s = buf.lstrip()
                if s and not (s.startswith(("<|", "to=")) or "<|".startswith(s) or "to=".startswith(s)):
                    self._mode = "plain"  # no header: the model answered in plain text
                    continue
                i = buf.find(H_MESSAGE)
                if i < 0:
                    break  # the header is not complete yet
                head = buf[:i]
                j = head.find(H_CHANNEL)
                name = head[j + len(H_CHANNEL):] if j >= 0 else ""
                self._channel = name.split("<|")[0].split()[0] if name.split() else ""
                to = _RECIPIENT.search(head)
                self._call = bool(self.calls and to and to.group(1).startswith("functions."))
                if self._call:
                    c.append(HARMONY_CALL + to.group(1)[len("functions."):] + "\n")
                self._buf, self._mode = buf[i + len(H_MESSAGE):], "body"
                continue
            cut = [(buf.find(m), m) for m in H_ENDS if m in buf]
            if cut:
                i, m = min(cut)
                self._body(r, c, buf[:i])
                if self._call:
                    c.append(HARMONY_CALL_END)
                    self._call = False
                # `<|start|>` opens the next message's header; an end marker is dropped
                self._buf, self._mode = (buf[i:] if m == "<|start|>" else buf[i + len(m):]), "header"
                continue
            keep = max(partial_suffix(buf, m) for m in H_ENDS)
            self._body(r, c, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            break
        return "".join(r), "".join(c)

    def _body(self, r: list, c: list, text: str) -> None:
        (r if self._channel in REASONING_CHANNELS and not self._call else c).append(text)

    def flush(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._mode == "body":  # an end marker cut off by the end of the output is markup, not text
            keep = max(partial_suffix(buf, m) for m in H_ENDS)
            buf = buf[: len(buf) - keep]
        if self._mode == "body" and self._call:  # ended by <|call|>, a stop token the text does not show
            self._call = False
            return "", buf + HARMONY_CALL_END
        if self._mode == "body" and self._channel in REASONING_CHANNELS:
            return buf, ""
        if self._mode == "header":
            return "", ""  # an unfinished header says nothing
        return "", buf
