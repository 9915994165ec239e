"""The server's connections: how long a request may take to arrive, how many connections are held at once.

uvicorn drops a connection idle between requests after its keep-alive timeout, but a client that opens one and
sends its request a byte every few seconds (headers or body) holds it forever; a few hundred such clients hold a
server's memory and sockets. Here a request must arrive whole — request line, headers and body — within
``request_timeout`` seconds of the connection's opening or of the previous answer's end (408, then closed), and
connections past ``max_connections`` are answered 503 and closed at once, as nginx's ``client_header_timeout``,
``client_body_timeout`` and ``worker_connections`` do.
"""

from __future__ import annotations

import json

REQUEST_TIMEOUT = 30.0  # seconds for a request to arrive whole
MAX_CONNECTIONS = 512
LINGER = 2.0  # seconds a timed-out connection is read (and what comes dropped) after its 408


def server_config(app, host: str, port: int, request_timeout: float = REQUEST_TIMEOUT,
                  max_connections: int = MAX_CONNECTIONS, **options):
    """uvicorn's ``Config`` for ``app`` with the limits above (``options``: uvicorn's own)."""
    import uvicorn

    check_limits(request_timeout, max_connections)
    protocol = bounded_protocol(request_timeout, max_connections)
    return uvicorn.Config(app, host=host, port=port, http=protocol, **options)


def check_limits(request_timeout: float, max_connections: int) -> None:
    if not 0 < request_timeout < 1e6:  # (NaN too)
        raise ValueError(f"--request-timeout must be a number of seconds above 0, got {request_timeout}")
    if max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {max_connections}")


def _raw_answer(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP answer in OpenAI's error shape that closes the connection, for moments with no ASGI app to
    answer (no request yet, or one still arriving)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def bounded_protocol(request_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with a deadline for each request's arrival and a cap on connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timed_out = _raw_answer(408, "Request Timeout", f"the request did not arrive whole within {request_timeout:g} "
                                                    f"s (--request-timeout)", "request_timeout")
    too_many = _raw_answer(503, "Service Unavailable", f"the server holds {max_connections} connections, its "
                                                       f"most (--max-connections); try again shortly", "busy")

    class BoundedH11Protocol(H11Protocol):
        deadline = None
        received = expired = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(too_many)
                transport.close()
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.expired:
                return  # (lingering: read and dropped)
            self.received = True
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if self.deadline is not None and cycle is not None and not cycle.more_body and \
                    self.conn.their_state is not h11.SEND_BODY:
                self._disarm()  # the request is whole: answering it may take as long as it takes

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is not h11.DONE:
                self.received = False
                self._arm()  # the next request's time starts now

        def _arm(self) -> None:
            self._disarm()
            self.deadline = self.loop.call_later(request_timeout, self._expire)

        def _disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            self.expired = True
            if self.cycle is not None:
                self.cycle.disconnected = True  # the app waiting for the body hears a disconnect
                self.cycle.message_event.set()
            if not self.received or self.cycle is not None and self.cycle.response_started:
                self.transport.close()
                return
            # the 408, then a lingering close (as nginx's): a close with the client's bytes unread would reset the
            # connection, and the client might never read the answer
            self.transport.write(timed_out)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER, self.transport.close)

    return BoundedH11Protocol


def check_api_key(key: str | None) -> None:
    """A key a client can send: not empty or blank (an empty one let ``Authorization: Bearer `` in), no spaces at
    its ends, no control characters (headers cannot carry them)."""
    if key is None:
        return
    if not isinstance(key, str) or not key.strip():
        raise ValueError("the API key (--api-key or TMAC_API_KEY) is empty: give a key, or set neither for a server "
                         "without one")
    if key != key.strip() or not key.isprintable() or not key.isascii():
        raise ValueError("the API key (--api-key or TMAC_API_KEY) has spaces at its ends, control or non-ASCII "
                         "characters, which an HTTP header cannot carry as they are")
