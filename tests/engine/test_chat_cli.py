"""`strata chat` to the end of a turn and beyond: through a pipe and through a terminal (a pty), several turns,
Ctrl-D. The embedded strata-tiny model ends its first reply with its end-of-turn token well before -n, which is
the path that used to crash."""

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

CHAT = [sys.executable, "-m", "strata", "chat", "--device", "cpu", "-n", "96", "--temperature", "0", "-v"]


def _turns(stderr: str) -> list[int]:
    """Tokens generated per turn, from the -v report."""
    return [int(n) for n in re.findall(r"generated (\d+) tokens", stderr)]


def test_chat_through_a_pipe_several_turns():
    r = subprocess.run(CHAT, input="Hello\n/reset\nWhat is a list?\n", capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    turns = _turns(r.stderr)
    assert len(turns) == 2
    assert min(turns) < 96  # at least one turn ended on the model's own end of turn
    # no prompt on a pipe: the replies alone (a reply may hold "> " itself, as in `def f(self) -> int:`)
    assert not any(line.startswith("> ") for line in r.stdout.splitlines()), r.stdout


def test_chat_quits_on_exit_and_says_nothing_of_it():
    """/exit (or /quit, /bye) ends the chat as Ctrl-D does: the lines after it are never read, nor is it a message."""
    r = subprocess.run(CHAT, input="Hello\n/exit\nWhat is a list?\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert len(_turns(r.stderr)) == 1 and "/exit" not in r.stdout


def _read_until(fd: int, pattern: bytes, timeout: float) -> bytes:
    buf = b""
    end = time.monotonic() + timeout
    while pattern not in buf:
        left = end - time.monotonic()
        assert left > 0, f"timed out waiting for {pattern!r}; got {buf[-500:]!r}"
        r, _, _ = select.select([fd], [], [], left)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_chat_in_a_terminal_two_turns_then_ctrl_d():
    master, slave = pty.openpty()
    p = subprocess.Popen(CHAT, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        out = _read_until(master, b"\n> ", 300)
        os.write(master, b"Hello\n")
        out += _read_until(master, b"\n> ", 600)
        os.write(master, b"Why?\n")
        out += _read_until(master, b"\n> ", 600)
        os.write(master, b"\x04")  # Ctrl-D at the prompt: quit
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    text = out.decode("utf-8", "replace")
    assert "Traceback" not in text
    turns = _turns(text)
    assert len(turns) == 2 and min(turns) < 96


def test_chat_takes_invalid_utf8_on_stdin():
    """Bytes that are not UTF-8 typed into the chat read as U+FFFD, whatever stdin's error handler (strict, or
    surrogateescape, which hands them on as lone surrogates the tokenizer cannot encode)."""
    for errors in ("strict", "surrogateescape"):
        env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONIOENCODING": f"utf-8:{errors}"}
        r = subprocess.run(CHAT, input=b"\xff\xfe bad utf8\nHello\n", capture_output=True, timeout=600, env=env)
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == 0 and "Traceback" not in err, (errors, err)
        assert len(_turns(err)) == 2 and r.stdout.strip(), (errors, err)


def test_chat_prints_no_think_tags():
    """strata-tiny's template (GLM-4.5's) has the model open every reply with an empty `<think></think>` block:
    the chat shows the answer alone, and --hide-reasoning changes nothing of it."""
    for extra in ([], ["--hide-reasoning"]):
        r = subprocess.run(CHAT + extra, input="Hello\nWhat is a list?\n", capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        assert len(_turns(r.stderr)) == 2 and r.stdout.strip()
        for tag in ("<think>", "</think>"):
            assert tag not in r.stdout and tag not in r.stderr, (extra, r.stdout, r.stderr)
        assert not r.stdout.startswith("\n"), r.stdout  # the blank lines after the block went with it


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_reasoning_goes_to_stderr_dimmed_and_hides_on_request():
    """A reply's reasoning, however the tokens cut its tags, goes to stderr (dimmed on a terminal, the answer on
    a line of its own) and never to stdout nor into the conversation; --hide-reasoning drops it."""
    from strata.engine.cli import DIM, RESET, Reply

    pieces = ["<thi", "nk>\nLet me", " think.", "</th", "ink>\n\nThe", " answer."]
    out, err = io.StringIO(), io.StringIO()
    r = Reply("{{ messages }}", in_reasoning=False, out=out, err=err)
    for p in pieces:
        r.put(p)
    r.end()
    assert (out.getvalue(), err.getvalue(), r.content) == ("The answer.", "Let me think.\n", "The answer.")
    out, err = io.StringIO(), _Tty()
    r = Reply(None, in_reasoning=True, out=out, err=err)  # the prompt opened the block
    for p in ["\nLet me", *pieces[2:]]:
        r.put(p)
    r.end()
    assert err.getvalue() == f"{DIM}Let me think.{RESET}\n" and out.getvalue() == "The answer."
    out, err = io.StringIO(), io.StringIO()
    r = Reply(None, in_reasoning=False, show_reasoning=False, out=out, err=err)
    for p in pieces:
        r.put(p)
    r.end()
    assert (out.getvalue(), err.getvalue()) == ("The answer.", "")
    out, err = io.StringIO(), _Tty()
    r = Reply(None, in_reasoning=False, out=out, err=err)  # cut off while thinking: the styling still ends
    r.put("<think>hmm")
    r.end()
    assert err.getvalue() == f"{DIM}hmm{RESET}\n" and out.getvalue() == "" and r.content == ""


def test_a_reply_the_context_cuts_short_says_so_and_the_chat_goes_on():
    """A reply that fills the context ends with a note, not as if the model had finished; a message that no longer
    fits is one line in the chat's terms (not an API's max_tokens), and /reset makes room again."""
    cmd = [sys.executable, "-m", "strata", "chat", "--device", "cpu", "-c", "48", "--temperature", "0", "-v"]
    r = subprocess.run(cmd, input="Hello\nWhy?\n/reset\nHi\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "[the context of 48 tokens is full: /reset starts over]" in r.stderr, r.stderr
    assert re.search(r"strata: the conversation is \d+ tokens with this message, the context holds 48: /reset "
                     r"starts over", r.stderr), r.stderr
    assert "max_tokens" not in r.stderr and len(_turns(r.stderr)) == 2  # Hello, then Hi after /reset
    r = subprocess.run(cmd + ["-n", "40"], input="Hello\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "with this message and -n 40 more, the context holds 48" in r.stderr, r.stderr



def test_an_unknown_command_is_said_not_sent():
    """A line of one /word is a command: /help lists them, an unknown one is named and never reaches the model; a
    message that only starts with a slash is a message."""
    r = subprocess.run(CHAT, input="/help\n/foo\n/usr/bin/env python\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "strata: unknown command /foo: /reset starts over" in r.stderr, r.stderr
    assert "strata: /reset starts over, /exit" in r.stderr, r.stderr
    assert len(_turns(r.stderr)) == 1  # only the path went to the model
