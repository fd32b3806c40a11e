"""A small read-only HTTP/1.1 server on the controller's own event loop.

It serves ``/metrics`` (Prometheus text), the status page ``/`` and
``/status.json``. Handlers run on the grpc.aio loop between two gRPC
callbacks, so they read controller state that no one is changing under
them — no locks, nothing added to the ingest path. A handler must only do
short work there (read state into plain values) and hand anything heavier
(rendering) to a thread with ``asyncio.to_thread``.

Every connection serves one request (``Connection: close``); the request
head must arrive within ``head_timeout_s`` and fit in ``max_head_bytes``,
so a slow or hostile client costs one idle coroutine at most that long.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Awaitable, Callable, Mapping
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("specctl.http")


def parse_host_port(text: str, field_name: str = "listen") -> tuple[str | None, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``:PORT`` for every interface).

    Returns ``(host, port)`` with ``host`` ``None`` for every interface.

    >>> parse_host_port("127.0.0.1:9100"), parse_host_port("[::1]:0"), parse_host_port(":9100")
    (('127.0.0.1', 9100), ('::1', 0), (None, 9100))
    >>> parse_host_port("localhost", "metrics_listen")
    Traceback (most recent call last):
    ...
    ValueError: metrics_listen='localhost': expected HOST:PORT
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"{field_name}={text!r}: expected HOST:PORT")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{field_name}={text!r}: port {port} is out of range 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None), port


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @classmethod
    def text(cls, status: int, message: str) -> "Response":
        return cls(status, (message + "\n").encode())


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """GET/HEAD routes on an asyncio server.

    Parameters
    ----------
    routes
        Exact path -> async handler.
    max_head_bytes
        Longest request line plus headers accepted.
    head_timeout_s
        Time a client has to send its request head.
    """

    def __init__(self, routes: Mapping[str, Handler], max_head_bytes: int = 16384,
                 head_timeout_s: float = 10.0) -> None:
        self.routes = dict(routes)
        self.max_head_bytes = max_head_bytes
        self.head_timeout_s = head_timeout_s
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, listen: str) -> int:
        """Listen on ``listen`` (``HOST:0`` picks a free port); returns the port."""
        host, port = parse_host_port(listen, "metrics_listen")
        self._server = await asyncio.start_server(self._serve, host, port, limit=self.max_head_bytes)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(self._read_head(reader), self.head_timeout_s)
            response = await self._respond(request) if isinstance(request, Request) else request
            await self._write(writer, response, head_only=isinstance(request, Request) and request.method == "HEAD")
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away or never finished its request: nothing to answer
        finally:
            writer.close()

    async def _read_head(self, reader: asyncio.StreamReader) -> Request | Response:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return Response.text(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                 f"request head exceeds {self.max_head_bytes} bytes")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return Response.text(HTTPStatus.BAD_REQUEST, f"malformed request line {lines[0][:200]!r}")
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        return Request(method, url.path or "/", query, headers)

    async def _respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET or HEAD\n", headers=(("Allow", "GET, HEAD"),))
        handler = self.routes.get(request.path)
        if handler is None:
            return Response.text(HTTPStatus.NOT_FOUND, f"no page at {request.path!r}; try " + ", ".join(self.routes))
        try:
            return await handler(request)
        except Exception:  # noqa: BLE001 - one failed page must not take the listener down
            log.exception("GET %s failed", request.path)
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the controller's log)")

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: Response, head_only: bool) -> None:
        status = HTTPStatus(response.status)
        head = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {response.content_type}",
                f"Content-Length: {len(response.body)}", "Cache-Control: no-store", "Connection: close",
                *(f"{k}: {v}" for k, v in response.headers)]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(response.body)
        await writer.drain()
