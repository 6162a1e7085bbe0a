"""The HTTP protocol `specrt serve` runs under uvicorn: uvicorn's h11 protocol plus a header timeout.

uvicorn times out only idle keep-alive connections between requests: a new connection that sends
nothing, or half a request line, is held forever (tried: 500 such connections, none closed after
40 s), which is how a slowloris client exhausts ``--max-connections``. ``TimedH11Protocol`` closes a
connection that has not delivered a complete request line and headers within ``header_timeout``
seconds of connecting or of its previous response. (The body's own deadline is the app's:
``ServerConfig.body_timeout``, a 408.) h11 is chosen explicitly so ``--max-header-bytes`` (h11's
``max_incomplete_event_size``) always applies, whichever parsers are installed.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11(header_timeout: float) -> type:
    """An ``H11Protocol`` subclass closing connections whose request headers take longer than ``header_timeout`` s."""

    class TimedH11Protocol(H11Protocol):
        timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.timer = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def _expired(self) -> None:
            """No complete request since the timer was armed (connect or last response): close."""
            self.timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol
