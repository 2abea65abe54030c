"""The HTTP port `serve` publishes: Triton's HTTP API, with generate requests checked before Triton.

Triton's own HTTP front end answers a generate body it cannot convert to the model's inputs (not JSON,
not an object, "ten" for an integer, -1 for an unsigned seed, "yes" for a boolean) with HTTP 500, as
if the server had failed. This front checks every generate body against the model's declared inputs
(model_repo/tokenswift/config.pbtxt) and answers a client's mistake with HTTP 400 and a one-line
message; a valid body, and every other request (health, metadata, statistics, the infer API), is
relayed to tritonserver unchanged, streamed responses (`generate_stream`'s server-sent events) as they
come. A client that disconnects mid-stream closes the relayed connection, so Triton cancels the request.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

GENERATE_PATH = re.compile(r"^/v2/models/[^/]+(?:/versions/[^/]+)?/generate(?:_stream)?/?$")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}
MAX_BODY_BYTES = 64 << 20
INT_RANGES = {"TYPE_INT32": (-(2**31), 2**31 - 1), "TYPE_UINT64": (0, 2**64 - 1)}


class BadRequest(ValueError):
    """A generate body the model cannot take: the message goes back with HTTP 400."""


def model_inputs(config_pbtxt: Path) -> dict[str, str]:
    """Input name -> Triton data type (TYPE_INT32, ...) from a model's config.pbtxt."""
    text = config_pbtxt.read_text()
    block = text[text.index("input [") : text.index("output [")]
    return dict(re.findall(r'name:\s*"([^"]+)"\s+data_type:\s*(TYPE_\w+)', block))


def check_generate_body(raw: bytes, inputs: dict[str, str]) -> None:
    """Raise BadRequest naming the first problem of a generate request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON ({error}): send a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(inputs))
    if unknown:
        raise BadRequest(f"unknown request field(s) {', '.join(unknown)}: the fields are {', '.join(inputs)}")
    for name, value in body.items():
        _check_value(name, value, inputs[name])


def _check_value(name: str, value: Any, kind: str) -> None:
    if isinstance(value, list):  # Triton takes a one-element list for a [1]-shaped input too
        if len(value) != 1:
            raise BadRequest(f"{name} must hold exactly one value, got {len(value)}")
        value = value[0]
    if kind == "TYPE_STRING":
        ok, expected = isinstance(value, str), "a string"
    elif kind == "TYPE_BOOL":
        ok, expected = isinstance(value, bool), "true or false"
    elif kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
        if ok:  # the range only where the value is a number outside it
            ok, expected = low <= value <= high, f"an integer in [{low}, {high}]"
    elif kind in ("TYPE_FP32", "TYPE_FP64"):
        ok, expected = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    else:
        return  # a type this front does not know: Triton checks it
    if not ok:
        raise BadRequest(f"{name} must be {expected}, got {json.dumps(value)}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FrontServer

    def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def _handle(self) -> None:
        try:
            body = self._read_body()
        except BadRequest as error:
            self._send_error(400, str(error))
            return
        if self.command == "POST" and GENERATE_PATH.match(self.path.split("?")[0]):
            try:
                check_generate_body(body, self.server.inputs)
            except BadRequest as error:
                self._send_error(400, str(error))
                return
        self._relay(body)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
                if sum(map(len, parts)) > MAX_BODY_BYTES:
                    raise BadRequest(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        return self.rfile.read(length) if length else b""

    def _send_error(self, status: int, message: str) -> None:
        """An error as Triton words it: JSON, or one server-sent event for `generate_stream`."""
        data = json.dumps({"error": message}).encode()
        content_type = "application/json"
        if self.path.split("?")[0].rstrip("/").endswith("/generate_stream"):
            data, content_type = b"data: " + data + b"\n\n", "text/event-stream; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _relay(self, body: bytes) -> None:
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=None)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
            except OSError as error:
                self._send_error(503, f"tritonserver is not reachable: {error}")
                return
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            if response.length is not None or self.command == "HEAD":  # a whole body of known length
                data = response.read()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                while piece := response.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away: closing upstream makes Triton cancel the request
                self.close_connection = True
        finally:
            upstream.close()


class _FrontServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstream: str, inputs: dict[str, str]) -> None:
        super().__init__(address, _Handler)
        self.upstream = upstream
        self.inputs = inputs


class HttpFront:
    """Serve `host:port`, relaying to tritonserver's HTTP endpoint `upstream` (HOST:PORT)."""

    def __init__(self, host: str, port: int, upstream: str, config_pbtxt: Path) -> None:
        try:
            self.server = _FrontServer((host, port), upstream, model_inputs(config_pbtxt))
        except OSError as error:
            message = f"cannot listen on {host}:{port} ({error.strerror}): choose another --http-port"
            raise OSError(message) from None
        self.thread = threading.Thread(target=self.server.serve_forever, name="http-front", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> HttpFront:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> HttpFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
