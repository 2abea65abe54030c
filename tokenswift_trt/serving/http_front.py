"""The HTTP port `serve` publishes: Triton's HTTP API, with generate requests checked before Triton.

Triton's own HTTP front end answers a generate body it cannot convert to the model's inputs (not JSON,
not an object, "ten" for an integer, -1 for an unsigned seed, "yes" for a boolean) with HTTP 500, as
if the server had failed. This front checks every generate body against the model's declared inputs
(model_repo/tokenswift/config.pbtxt) and answers a client's mistake with HTTP 400 and a one-line
message; a valid body, and every other request (health, metadata, statistics, the infer API), is
relayed to tritonserver unchanged, streamed responses (`generate_stream`'s server-sent events) as they
come. A client that disconnects mid-stream closes the relayed connection, so Triton cancels the request.

Triton answers every error of the model with 400; a server fault's message names its cause
(serving/errors.py), and this front answers it with the cause's status (503 with Retry-After for "server
busy", 500 for "generation failed"). A stream that tritonserver cuts (it stopped) ends with an error
event, never as if the generation had finished.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tokenswift_trt.serving.errors import SHUTTING_DOWN, cause_of

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
        if ok:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                raise BadRequest(
                    f"{name} is not valid Unicode (a lone surrogate at character {error.start}): "
                    "send UTF-8 text"
                ) from None
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
        with self.server.tracked():
            try:
                body = self._read_body()
            except BadRequest as error:
                self._send_error(400, str(error))
                return
            if self.command == "POST" and GENERATE_PATH.match(self.path.split("?")[0]):
                if self.server.draining:
                    message = f"{SHUTTING_DOWN.words}: send the request again once it is back"
                    self._send_error(SHUTTING_DOWN.status, message, SHUTTING_DOWN.retry_after_s)
                    return
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

    def _send_error(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        """An error as Triton words it: JSON, or one server-sent event for `generate_stream`."""
        data = json.dumps({"error": message}).encode()
        content_type = "application/json"
        if self.path.split("?")[0].rstrip("/").endswith("/generate_stream"):
            data, content_type = b"data: " + data + b"\n\n", "text/event-stream; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if retry_after_s is not None:
            self.send_header("Retry-After", str(retry_after_s))
        self.end_headers()
        self.wfile.write(data)

    def _cut_event(self) -> bytes:
        """The error event that ends a stream tritonserver stopped sending."""
        if self.server.draining:
            message = f"{SHUTTING_DOWN.words}: the generation was stopped before it finished"
        else:
            message = "generation failed: tritonserver stopped answering before the generation finished"
        return b"data: " + json.dumps({"error": message}).encode() + b"\n\n"

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
            if response.status == 400:  # a model error: the server's own where its message names a cause
                data = response.read()
                message = _error_message(data)
                cause = cause_of(message) if message else None
                if cause is not None:
                    self._send_error(cause.status, message, cause.retry_after_s)
                    return
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
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
                while True:
                    try:
                        piece = response.read1(65536)
                    except (OSError, http.client.HTTPException):  # tritonserver cut the stream
                        piece = self._cut_event()
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        break
                    if not piece:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away: closing upstream makes Triton cancel the request
                self.close_connection = True
        finally:
            upstream.close()


def _error_message(data: bytes) -> str | None:
    """The "error" of Triton's error body (JSON, or one server-sent event)."""
    text = data.decode("utf-8", errors="replace").strip().removeprefix("data:").strip()
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return None
    return str(body["error"]) if isinstance(body, dict) and "error" in body else None


class TrackedServer(ThreadingHTTPServer):
    """A threading HTTP server for many clients at once (a deep listen backlog: a burst of clients
    waits instead of being reset) that counts the requests being answered, so that a shutdown can wait
    for them (`wait_idle`). Both of `serve`'s fronts are one."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.active = 0  # requests being answered
        self.idle = threading.Condition()
        super().__init__(address, handler)

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        """Count a request while it is answered."""
        with self.idle:
            self.active += 1
        try:
            yield
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every request being answered to end; whether they did."""
        with self.idle:
            return self.idle.wait_for(lambda: self.active == 0, timeout=timeout_s)


class _FrontServer(TrackedServer):
    def __init__(self, address: tuple[str, int], upstream: str, inputs: dict[str, str]) -> None:
        super().__init__(address, _Handler)
        self.upstream = upstream
        self.inputs = inputs
        self.draining = False  # shutting down: generate requests are refused


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

    def drain(self) -> None:
        """Refuse new generate requests ("server shutting down", 503); streams cut from now on say so."""
        self.server.draining = True

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop serving, after up to `grace_s` seconds for the requests being answered to end."""
        if grace_s > 0:
            self.server.wait_idle(grace_s)
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def __enter__(self) -> HttpFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
