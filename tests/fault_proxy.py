"""An HTTP proxy on 127.0.0.1 in front of the S3 test server that injects faults by rule.

Clients (the driver and the rank actors) talk to the proxy as if it were S3. Each request is
matched against the rules in order; a matching rule with injections left decides the fault:

    slowdown     503 SlowDown, the S3 throttling reply
    error500     500 InternalError
    denied       403 AccessDenied, what S3 answers a request its policy refuses (never retried)
    reset        the connection is reset before the request reaches the server
    reset_after  the server handles the request, then the connection is reset: the reply is
                 lost, so a retried conditional PUT meets its own earlier write
    cut_body     the reply's headers and the first half of its body are sent (with the whole
                 body's Content-Length), then the connection is reset: a download breaks midway
    delay        wait `seconds`, then forward
    stall        accept the request and never answer (until `seconds` pass)

A rule may also carry a `callback(method, target)`, run when it injects: crash tests use it to
kill a rank actor or the driver at an exact point of the storage protocol (e.g. on the PUT of
LATEST, between the manifest and the pointer move). Faults are counted per rule, so tests can
check they really happened.
"""
from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("slowdown", "error500", "denied", "reset", "reset_after", "cut_body", "delay", "stall")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"}


@dataclass
class Rule:
    fault: str
    method: str | None = None  # GET, PUT, POST, HEAD, DELETE; None: any
    path: str = ""  # regular expression searched in "path?query"
    times: int = 1_000_000  # injections before the rule goes quiet
    skip: int = 0  # matching requests let through before the first injection
    seconds: float = 0.0  # for delay and stall
    callback: Callable[[str, str], None] | None = None
    probability: float = 1.0  # of injecting into a matching request (a soak faults a share of all traffic)
    rng: random.Random | None = None  # seeded by the test, so a soak's faults can be replayed
    seen: int = 0
    injected: int = 0

    def matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method == method) and re.search(self.path, target) is not None


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, listen_port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []  # (method, target) of every request, for debugging
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", listen_port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, fault: str, **match) -> Rule:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; one of {FAULTS}")
        rule = Rule(fault, **match)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.requests.clear()

    def decide(self, method: str, target: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, target))
            for rule in self.rules:
                if rule.matches(method, target):
                    rule.seen += 1
                    chance = rule.probability >= 1.0 or (rule.rng or random).random() < rule.probability
                    if rule.seen > rule.skip and rule.injected < rule.times and chance:
                        rule.injected += 1
                        return rule
        return None


def _handler_for(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint

        def log_message(self, *args) -> None:  # quiet: pytest shows failures, not traffic
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return bytes(data)
                    data += self.rfile.read(size)
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _reset(self) -> None:
            # SO_LINGER 0 makes close() send RST: the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

        def _error(self, status: int, code: str, message: str) -> None:
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":  # a body after a HEAD reply would be read as the next reply
                self.wfile.write(body)

        def _handle(self) -> None:
            body = self._body()
            rule = proxy.decide(self.command, self.path)
            fault = rule.fault if rule else None
            if rule is not None and rule.callback is not None:
                rule.callback(self.command, self.path)
            if fault == "slowdown":
                return self._error(503, "SlowDown", "Please reduce your request rate.")
            if fault == "error500":
                return self._error(500, "InternalError", "We encountered an internal error. Please try again.")
            if fault == "denied":
                return self._error(403, "AccessDenied", "Access Denied")
            if fault == "reset":
                return self._reset()
            if fault == "stall":
                time.sleep(rule.seconds)
                return self._reset()
            if fault == "delay":
                time.sleep(rule.seconds)
            status, headers, payload = self._forward(body)
            if fault == "reset_after":
                return self._reset()
            self.send_response(status)
            for name, value in headers:
                if name.lower() not in _HOP_HEADERS and not (name.lower() == "content-length" and self.command != "HEAD"):
                    self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if fault == "cut_body":
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                return self._reset()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _forward(self, body: bytes):
            connection = http.client.HTTPConnection(*proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                return response.status, response.getheaders(), payload
            finally:
                connection.close()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    return Handler
