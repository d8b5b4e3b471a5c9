"""Byte transfer for `strata pull`: one URL into one `.part` file, resumable, strict about what it accepts.

The rules here are the whole point of this module (each one closes a way a real downloader produced a file
that looked finished and was not):

- A resumed request asks for `Range: bytes=N-`; its bytes are accepted only from a 206 whose Content-Range
  starts exactly at N. A 206 starting anywhere else is discarded and the file restarts from zero; a 200 to a
  ranged request means the server ignored the range, so its body is written from offset 0.
- The expected size comes from the caller (the hub's API metadata or a manifest), never from a HEAD request.
  When no size is known, the size a GET announces is used for this transfer only, and when the server
  announces none at all the transfer is reported as size-unknown: it never counts as complete by itself.
- A body that ends before the announced length (dropped connection) is resumed from what is on disk.
- The ETag of the response a `.part` file's bytes came from is kept beside it (`<file>.part.etag`), so that a
  resume, in this run or a later one, asks for the rest of that same file (`If-Range`: a server whose file
  changed answers 200 with the whole new one) and refuses a 206 carrying another ETag: the bytes of two
  versions of a file are never stitched together, as llama.cpp's downloader refuses to.
- A write failing (ENOSPC, EFBIG, ...) becomes one clear error; the `.part` file is kept for a later resume.

Hashing and the `.done` marker are the caller's business (see `strata.hub.verify`): nothing written here
looks finished.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterator, Protocol

import httpx

from strata import StrataError

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


class Task(Protocol):
    """One progress bar: bytes done out of a total (None when unknown)."""

    def update(self, completed: int, total: int | None = None) -> None: ...

    def advance(self, n: int) -> None: ...


class NullTask:
    def update(self, completed: int, total: int | None = None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


OpenFile = Callable[[Path, str], BinaryIO]


@dataclass
class Transfer:
    """What one completed transfer left in the `.part` file."""

    size: int  # bytes in the .part file
    size_confirmed: bool  # True when a known size (caller's or the server's announcement) was reached exactly
    requests: int  # GET requests made


class _Retry(Exception):
    """A recoverable failure of one request: back off and try again (after `after` seconds at least, when the
    server said so with Retry-After)."""

    def __init__(self, msg: str, after: float | None = None) -> None:
        super().__init__(msg)
        self.after = after


# a host that has not answered once in this transfer (no name, nothing listening, every connect timing out) is tried
# this many times, not `retries` times with the backoff (~3 minutes at the default 8): as curl and wget treat a
# refused connection and an unknown name, the cause is the address or the network, which waiting does not fix
UNREACHABLE_TRIES = 2
RETRY_AFTER_MAX = 300.0  # the longest Retry-After obeyed; a longer one is waited this long, then tried again


def _retry_after(r: httpx.Response) -> float | None:
    """Retry-After as seconds (RFC 9110: delay-seconds or an HTTP date), None when absent or unreadable."""
    v = (r.headers.get("retry-after") or "").strip()
    if not v:
        return None
    if v.isdigit():
        return float(v)
    try:
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class _Complete(Exception):
    """The server says the resume offset is its file's end (416 with `bytes */N`, N == bytes held)."""


class Cancel(threading.Event):
    """Ctrl-C for transfers: once set, each stops at its next chunk, and one blocked in a read (a stalled server)
    stops at once, its socket shut down, instead of at its read timeout."""

    def __init__(self) -> None:
        super().__init__()
        self._sockets: set[socket.socket] = set()
        self._guard = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._guard:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    @contextmanager
    def watching(self, r: httpx.Response) -> Iterator[None]:
        stream = r.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            yield
            return
        with self._guard:
            self._sockets.add(sock)
        try:
            if self.is_set():  # set before the socket was known
                _shut(sock)
            yield
        finally:
            with self._guard:
                self._sockets.discard(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Interrupted(StrataError):
    """The transfer was cancelled (Ctrl-C in `strata pull`); the `.part` file is kept for a resume."""


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """`bytes START-END/TOTAL` -> (start, end inclusive, total or None); None when absent or malformed."""
    if not value:
        return None
    m = _CONTENT_RANGE.match(value)
    if not m:
        return None
    start, end = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    if end < start or (total is not None and end >= total):
        return None
    return start, end, total


def _content_length(r: httpx.Response) -> int | None:
    v = r.headers.get("content-length")
    if v is None or not v.strip().isdigit():
        return None
    return int(v)


def _part_size(part: Path) -> int:
    try:
        return part.stat().st_size
    except FileNotFoundError:
        return 0


def _truncate(part: Path, size: int, open_file: OpenFile) -> None:
    if part.exists():
        with open_file(part, "r+b") as f:
            f.truncate(size)


def etag_path(part: Path) -> Path:
    return part.with_name(part.name + ".etag")


def _read_etag(part: Path) -> str | None:
    try:
        return etag_path(part).read_text().strip() or None
    except OSError:
        return None


def _record_etag(part: Path, etag: str | None) -> None:
    if etag:
        etag_path(part).write_text(etag + "\n")
    else:
        etag_path(part).unlink(missing_ok=True)


def discard_part(part: Path) -> None:
    """Remove a `.part` file and the ETag its bytes came with."""
    part.unlink(missing_ok=True)
    etag_path(part).unlink(missing_ok=True)


def _is_disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def fetch_to_part(
    client: httpx.Client,
    url: str,
    part: Path,
    *,
    expected_size: int | None,
    headers: dict[str, str] | None = None,
    retries: int = 5,
    backoff: float = 1.0,
    task: Task | None = None,
    warn: Callable[[str], None] = lambda msg: None,
    open_file: OpenFile = open,  # type: ignore[assignment]
    sleep: Callable[[float], None] = time.sleep,
    cancelled: Callable[[], bool] = lambda: False,
    watch: Callable[[httpx.Response], ContextManager] | None = None,
) -> Transfer:
    """Download `url` into `part`, resuming from what `part` already holds.

    Returns once the file holds `expected_size` bytes (or, with no expected size, once a body of announced
    length, or an unannounced one, has been read to its end: `size_confirmed` tells the two apart). Raises
    StrataError after `retries` failed attempts in a row without progress, on a fatal HTTP status, or when
    the disk is full.
    """
    task = task or NullTask()
    name = part.name.removesuffix(".part")
    total = expected_size  # the size this transfer must reach; from the caller, else from the server
    attempts = 0  # failures since the file last grew past its high-water mark
    high_water = _part_size(part)
    requests = 0
    part.parent.mkdir(parents=True, exist_ok=True)
    etag = _read_etag(part) if high_water else None  # the version of the file the bytes held are of
    answered = False  # any response from the server in this transfer

    while True:
        if cancelled():
            raise Interrupted(f"{name}: interrupted ({_part_size(part)} bytes kept in {part.name})")
        have = _part_size(part)
        if total is not None and have > total:
            warn(f"{name}: partial file is larger than the expected {total} bytes; starting over")
            _truncate(part, 0, open_file)
            have = 0
        if total is not None and have == total:
            task.update(have, total)
            return Transfer(have, True, requests)
        task.update(have, total)

        req_headers = dict(headers or {})
        req_headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file itself
        if have > 0:
            req_headers["Range"] = f"bytes={have}-"
            if etag and not etag.startswith("W/"):  # a weak validator may not be used in If-Range
                req_headers["If-Range"] = etag
        try:
            requests += 1
            with client.stream("GET", url, headers=req_headers) as r, (watch or _no_watch)(r):
                answered = True
                offset, body_len, total = _accept(r, have, total, name, part, warn, open_file, etag)
                got = r.headers.get("etag")
                if offset == 0 or etag is None:
                    if offset == 0:
                        _truncate(part, 0, open_file)  # no old byte may outlive the record of the new version
                    _record_etag(part, got)
                    etag = got
                written_end = _write_body(r, part, offset, total, task, open_file, cancelled)
            if body_len is not None and written_end != body_len[0] + body_len[1]:
                raise _Retry(f"body ended at byte {written_end}, not at {body_len[0] + body_len[1]} as announced")
            if total is None:
                # No size from the caller nor from the server: reading to EOF proves nothing.
                return Transfer(written_end, False, requests)
            if written_end < total:
                raise _Retry(f"got {written_end} of {total} bytes")
        except _Complete:
            task.update(have, have)
            return Transfer(have, True, requests)
        except (httpx.TransportError, _Retry) as e:
            if cancelled():  # the error is the cancel's own doing (its socket shut down)
                raise Interrupted(f"{name}: interrupted ({_part_size(part)} bytes kept in {part.name})") from e
            size_now = _part_size(part)
            if size_now > high_water:  # progress: a flaky link that keeps moving is not a failing one
                high_water = size_now
                attempts = 0
            attempts += 1
            if not answered and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) \
                    and attempts >= UNREACHABLE_TRIES:
                host = httpx.URL(url).host
                raise StrataError(f"{name}: cannot connect to {host} ({_describe(e)}, {attempts} tries): check the "
                                  f"address and the network") from e
            if attempts > retries:
                raise StrataError(f"{name}: download failed after {retries} retries: {_describe(e)}") from e
            delay = min(backoff * 2 ** (attempts - 1), 60.0)
            if isinstance(e, _Retry) and e.after is not None:  # a rate limit's own word on when to come back
                delay = min(max(delay, e.after), RETRY_AFTER_MAX)
            warn(f"{name}: {_describe(e)}; retry {attempts}/{retries} in {delay:.1f}s")
            sleep(delay)
        except httpx.TooManyRedirects as e:  # a redirect loop does not end by being tried again
            raise StrataError(f"{name}: too many redirects from {url} (a loop?)") from e
        except OSError as e:
            if _is_disk_full(e):
                raise StrataError(
                    f"no space left on the device while writing {part} ({_part_size(part)} bytes kept; "
                    "free some space and run the same command again to resume)"
                ) from e
            # EFBIG (a file-size limit), EIO, EROFS...: as final for this run as a full disk, and as resumable
            raise StrataError(
                f"cannot write {part}: {e.strerror or e} ({_part_size(part)} bytes kept; once that is fixed, "
                "run the same command again to resume)"
            ) from e


def _where(r: httpx.Response) -> str:
    """The request's URL without its query (a CDN's signed one is long, and a credential)."""
    return str(r.request.url.copy_with(query=None))


def _access_denied(r: httpx.Response, name: str) -> str:
    said = (r.headers.get("x-error-message") or "").strip()
    said = f" ({said})" if said else ""
    if r.status_code == 401 and "authorization" not in r.request.headers:
        advice = ("the server wants credentials: for a Hugging Face model, set HF_TOKEN (or pass --token, or run "
                  "`hf auth login`), and for a gated one accept its license on its page with that account")
    else:
        advice = ("the token was refused or has no access: for a gated model, accept its license on its page on "
                  "the hub with the account of the token in use (HF_TOKEN, --token), or use a token with read access")
    return f"{name}: HTTP {r.status_code} from {r.request.url.netloc.decode()}{said}: {advice}"


def _no_watch(r: httpx.Response) -> ContextManager:
    return nullcontext()


def _describe(e: Exception) -> str:
    if isinstance(e, httpx.TransportError):
        return f"connection error ({type(e).__name__}: {e})"
    return str(e)


def _accept(
    r: httpx.Response,
    have: int,
    total: int | None,
    name: str,
    part: Path,
    warn: Callable[[str], None],
    open_file: OpenFile,
    etag: str | None = None,
) -> tuple[int, tuple[int, int] | None, int | None]:
    """Decide what the response's body is worth.

    Returns (offset to write at, (offset, announced body length) or None when unannounced, total size).
    Raises _Retry for a response whose bytes must not be used; StrataError for a fatal status.
    """
    code = r.status_code
    if code in RETRY_STATUS:
        raise _Retry(f"HTTP {code}", _retry_after(r))
    if code == 416 and have > 0:
        cr = re.match(r"^\s*bytes\s+\*/(\d+)\s*$", r.headers.get("content-range", ""))
        if cr and int(cr.group(1)) == have and total in (None, have):
            raise _Complete()  # what we hold is the whole file as the server sees it; the hash judges
        # The range is past the end as the server sees it: what we hold is not a prefix of its file.
        _truncate(part, 0, open_file)
        raise _Retry(f"HTTP 416 for a resume from byte {have}: starting over")
    if code in (401, 403):
        raise StrataError(_access_denied(r, name))
    if code >= 400:
        raise StrataError(f"{name}: HTTP {code} from {_where(r)}")
    if r.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        # Offsets and hashes are of the file itself; a compressed body is neither.
        raise _Retry(f"server sent a {r.headers['content-encoding']}-encoded body despite Accept-Encoding: identity")

    if code == 206:
        cr = parse_content_range(r.headers.get("content-range"))
        if have == 0 or cr is None or cr[0] != have:
            got = r.headers.get("content-range", "no Content-Range")
            _truncate(part, 0, open_file)
            raise _Retry(f"asked for bytes {have}- but got a 206 with {got!r}: bytes discarded, starting over")
        start, end, server_total = cr
        got = r.headers.get("etag")
        if etag and got and got != etag:  # a server that ignored If-Range, or a CDN node with another version
            _truncate(part, 0, open_file)
            raise _Retry(f"the file changed on the server since the partial download (ETag {etag}, now {got}): "
                         "bytes discarded, starting over")
        if total is not None and server_total is not None and server_total != total:
            raise _Retry(f"server reports {server_total} bytes for the file, {total} expected")
        total = total if total is not None else server_total
        body = end - start + 1
        cl = _content_length(r)
        if cl is not None and cl != body:
            raise _Retry(f"206 with Content-Length {cl} for a {body}-byte range")
        return have, (have, body), total

    if code == 200:
        if have > 0:
            got = r.headers.get("etag")
            why = "the file changed on the server since the partial download" if etag and got and got != etag \
                else "server ignored the resume range"
            warn(f"{name}: {why} (HTTP 200); starting over from byte 0")
        cl = _content_length(r)
        if total is not None and cl is not None and cl != total:
            raise _Retry(f"server announces {cl} bytes, {total} expected")
        if total is None:
            total = cl
        return 0, (0, cl) if cl is not None else None, total

    raise _Retry(f"unexpected HTTP {code}")


def _write_body(
    r: httpx.Response,
    part: Path,
    offset: int,
    total: int | None,
    task: Task,
    open_file: OpenFile,
    cancelled: Callable[[], bool],
) -> int:
    """Write the body at `offset` (truncating what follows), return the offset after the last byte."""
    mode = "r+b" if part.exists() else "wb"
    with open_file(part, mode) as f:
        f.seek(offset)
        f.truncate(offset)
        task.update(offset, total)
        for chunk in r.iter_raw():  # as received: a chunker would lose its buffer when the link drops
            if total is not None and offset + len(chunk) > total:
                # Drop the chunk: the retry resumes after the last byte that fits, and the full hash judges.
                raise _Retry(f"server sent more than the expected {total} bytes")
            f.write(chunk)
            offset += len(chunk)
            task.advance(len(chunk))
            if cancelled():
                name = part.name.removesuffix(".part")
                raise Interrupted(f"{name}: interrupted ({offset} bytes kept in {part.name})")
        f.flush()
        os.fsync(f.fileno())
    return offset


def first_line(e: BaseException) -> str:
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


def is_transport_error(e: BaseException) -> bool:
    """Connection, timeout and protocol errors of any httpx-like stack, by class name up the hierarchy."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"TransportError", "HTTPError", "ConnectError", "TimeoutException", "NetworkError",
                         "ProtocolError", "RequestError", "ConnectionError"})
