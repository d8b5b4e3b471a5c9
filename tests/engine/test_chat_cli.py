"""`strata chat` to the end of a turn and beyond: through a pipe and through a terminal (a pty), several turns,
Ctrl-D. The embedded strata-tiny model ends its first reply with its end-of-turn token well before -n, which is
the path that used to crash."""

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
