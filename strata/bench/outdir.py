"""Where a bench run's files go: a fresh directory per run, files replaced whole, and a run that stops early
saying so instead of leaving a directory that looks like results."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator

from strata import StrataError


def fresh_dir(root: Path, name: str) -> Path:
    """A new directory under --out, made before any server starts: a bad --out costs no measuring."""
    d, i = root / name, 2
    while d.exists():
        d, i = root / f"{name}-{i}", i + 1
    try:
        d.mkdir(parents=True)
    except OSError as e:
        up = next((a for a in [root, *root.parents] if a.exists()), None)
        why = f"{up} is not a directory" if up is not None and not up.is_dir() else e.strerror or str(e)
        raise StrataError(f"--out {root}: cannot create {d}: {why}") from None
    return d


def write_text(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never a part of it (a reader polling for results, a full disk,
    Ctrl-C mid-write): the text goes to a temporary file beside it, renamed over it once complete."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError):
            raise StrataError(f"cannot write {path}: {e.strerror or e}") from None
        raise


@contextlib.contextmanager
def unfinished(out: Path, say: Callable[[str], None]) -> Iterator[None]:
    """A run that stops before its results are written (an error, a server gone, Ctrl-C) says that none were,
    and leaves no empty directory behind."""
    try:
        yield
    except BaseException:
        try:
            empty = not any(out.iterdir())
        except OSError:
            empty = False
        if empty:
            with contextlib.suppress(OSError):
                out.rmdir()
            say("stopped: no results written")
        else:
            say(f"stopped: no results written ({out} holds the servers' logs only)")
        raise
