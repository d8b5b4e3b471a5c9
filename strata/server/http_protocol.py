"""uvicorn's HTTP/1.1 protocol (h11) with read and write timeouts.

uvicorn times out only an idle keep-alive connection after a response; a connection that sends nothing, stops
part way through its headers, or stops part way through its body is held open forever (the route waits on the
body with no deadline), and enough of them exhaust the server's file descriptors. As llama.cpp's server does
(its --timeout), a connection that sends no byte for `timeout_s` while the server waits for its request is
closed: the route waiting on its body then sees a disconnect, and nothing has taken a slot. A response being
written (a stream) is never cut by this: the client owes no bytes then.

A client that stops reading its response (a stream it no longer consumes, its socket left open) fills the socket
buffers; uvicorn then pauses the response's writes, and the generation behind it would hold its slot to
max_tokens and the connection forever. When the client takes no byte of the response for `timeout_s` (as
llama.cpp's write timeout), the connection is dropped: the stream sees a disconnect and its slot is freed. A
slow reader that still takes bytes is not cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

try:
    import fcntl
    import termios
except ImportError:  # (Windows: the transport's buffer alone tells)
    fcntl = termios = None

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol_with_timeouts(timeout_s: float) -> type:
    class TimeoutH11(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            for t in (self._read_timer, self._write_timer):
                if t is not None:
                    t.cancel()
            self._read_timer = self._write_timer = None
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._watch_writes()

        def resume_writing(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().resume_writing()

        def _unsent(self) -> int:
            """Response bytes the client has not taken: the transport's buffer and the kernel's send queue (which
            the kernel grows to megabytes: the transport's buffer alone moves only once a good part of it drains)."""
            n = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if sock is not None and termios is not None and hasattr(termios, "TIOCOUTQ"):
                with contextlib.suppress(OSError):
                    n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            return n

        def _watch_writes(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
            self._write_timer = self.loop.call_later(timeout_s, self._write_check, self._unsent())

        def _write_check(self, unsent: int) -> None:
            self._write_timer = None
            if self.transport.is_closing() or not self.flow.write_paused:
                return
            if self._unsent() < unsent:  # the client took some: it reads, slowly
                self._watch_writes()
                return
            # (abort, not close: close would wait for the buffer to drain to a client that does not read)
            self.transport.abort()

        def _arm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                # the first request's headers are owed from the start, a later one's from its first byte: an idle
                # kept-alive connection owes nothing and lasts uvicorn's keep-alive time
                owed = self.conn.their_state is h11.IDLE and (cycle is None or bool(self.conn.trailing_data[0]))
            else:  # a request under way: its body is owed, and no response has begun
                owed = self.conn.their_state is h11.SEND_BODY and not cycle.response_started
            if owed:
                self.transport.close()

    return TimeoutH11
