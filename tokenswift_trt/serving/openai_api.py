"""An OpenAI-compatible HTTP front for the `tokenswift` Triton model.

`/v1/completions`, `/v1/chat/completions` (streaming by server-sent events or not) and `/v1/models`,
served by a stdlib HTTP server next to tritonserver. Each OpenAI request becomes one call to Triton's
generate extension on that server (`generate`, or `generate_stream` when streaming), so it goes
through the same request handler, with the same engine defaults, as a Triton client's request; the
answer is translated back into OpenAI's response, chunk and error objects.

This module is the HTTP side (routes, server-sent events, the listening server); requests are
checked and translated in `openai_requests.py`, responses and stream chunks built in
`openai_responses.py`, and Triton is called through `openai_triton.py`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tokenswift_trt.serving.errors import SHUTTING_DOWN
from tokenswift_trt.serving.http_front import TrackedServer
from tokenswift_trt.serving.openai_requests import ApiError, FrontendError, ServedModel, _check_unicode
from tokenswift_trt.serving.openai_responses import OpenAIApi
from tokenswift_trt.serving.openai_triton import TritonGenerate

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "tokenswift-openai"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send_json(self, status: int, data: dict[str, Any], retry_after_s: int | None = None) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        if retry_after_s is not None:
            self.send_header("Retry-After", str(retry_after_s))
        self.end_headers()
        self.wfile.write(raw)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, error.body(), error.retry_after_s)

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ApiError("Content-Length is not a number") from None
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ApiError(f"the body is not JSON ({error}): send a JSON object") from None
        if not isinstance(body, dict):
            raise ApiError("the body must be a JSON object")
        _check_unicode(body, "")
        return body

    def do_GET(self) -> None:
        api = self.server.api
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self._send_json(200, api.models())
        elif path == f"/v1/models/{api.model.name}":
            self._send_json(200, api.model_card())
        elif path.startswith("/v1/models/"):
            error = ApiError(
                f"the model {path.removeprefix('/v1/models/')!r} does not exist: this server serves "
                f"{api.model.name!r}",
                status=404,
                code="model_not_found",
            )
            self._send_json(error.status, error.body())
        else:
            self._not_found()

    def _not_found(self) -> None:
        error = ApiError(
            f"no endpoint {self.command} {self.path}: this server has GET /v1/models, "
            "POST /v1/completions and POST /v1/chat/completions",
            status=404,
            code="not_found",
        )
        self._send_json(error.status, error.body())

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._not_found()
            return
        chat = path == "/v1/chat/completions"
        api = self.server.api
        with self.server.tracked():
            try:
                body = self._body()
                if api.draining:
                    raise ApiError.server(
                        SHUTTING_DOWN, f"{SHUTTING_DOWN.words}: send the request again once it is back"
                    )
                if body.get("stream") is True:
                    chunks, close = api.open_stream(body, chat)
                else:
                    self._send_json(200, api.complete(body, chat))
                    return
            except ApiError as error:
                self._send_error(error)
                return
            except Exception as error:  # a fault of this server: answer the client, keep serving
                log.exception("openai front: request failed")
                self._send_error(ApiError(f"internal error: {error}", status=500, kind="server_error"))
                return
            self._stream(chunks, close)

    def _stream(self, chunks: Iterator[dict[str, Any]], close: Callable[[], None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            while True:
                try:
                    data = next(chunks)
                except StopIteration:
                    break
                except ApiError as error:  # after the stream began: an error event, as OpenAI sends
                    data = error.body()
                self._event(json.dumps(data))
                if "error" in data:
                    break
            self._event("[DONE]")
        except OSError:  # the client left: drop Triton's stream (it cancels the generation)
            pass
        finally:
            close()

    def _event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()


class _Server(TrackedServer):
    def __init__(self, address: tuple[str, int], api: OpenAIApi) -> None:
        self.api = api
        super().__init__(address, _Handler)


class OpenAIFrontend:
    """The OpenAI-compatible front of a running tritonserver, served from a daemon thread."""

    def __init__(
        self,
        triton_http_url: str,
        model_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 9000,
        served_model_name: str | None = None,
        timeout_s: float = 3600.0,
    ) -> None:
        self.model = ServedModel.from_dir(Path(model_dir), served_model_name)
        self.api = OpenAIApi(self.model, TritonGenerate(triton_http_url, timeout_s))
        self.host = host
        self.port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL for OpenAI clients (`openai.OpenAI(base_url=...)`)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> OpenAIFrontend:
        try:
            self._server = _Server((self.host, self.port), self.api)
        except OSError as error:
            raise FrontendError(
                f"the OpenAI front cannot listen on {self.host}:{self.port} ({error.strerror or error}): "
                "choose another --openai-port"
            ) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="openai-front", daemon=True)
        self._thread.start()
        return self

    def drain(self) -> None:
        """Refuse new requests ("server shutting down", 503); streams the inference server cuts from
        now on end with finish_reason "abort" and that error."""
        self.api.draining = True

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop serving, after up to `grace_s` seconds for the requests being answered to end."""
        if self._server is not None:
            if grace_s > 0:
                self._server.wait_idle(grace_s)
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> OpenAIFrontend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
