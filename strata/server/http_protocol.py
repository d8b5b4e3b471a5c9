"""uvicorn's HTTP/1.1 protocol (h11) with a read timeout.

uvicorn times out only an idle keep-alive connection after a response; a connection that sends nothing, stops
part way through its headers, or stops part way through its body is held open forever (the route waits on the
body with no deadline), and enough of them exhaust the server's file descriptors. As llama.cpp's server does
(its --timeout), a connection that sends no byte for `timeout_s` while the server waits for its request is
closed: the route waiting on its body then sees a disconnect, and nothing has taken a slot. A response being
written (a stream) is never cut by this: the client owes no bytes then.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol_with_read_timeout(timeout_s: float) -> type:
    class ReadTimeoutH11(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # between requests: the next one's headers are owed
                owed = self.conn.their_state is h11.IDLE
            else:  # a request under way: its body is owed, and no response has begun
                owed = self.conn.their_state is h11.SEND_BODY and not cycle.response_started
            if owed:
                self.transport.close()

    return ReadTimeoutH11
