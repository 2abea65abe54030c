"""Calls to Triton's generate extension for the `tokenswift` model, and Triton's errors as OpenAI
errors."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from tokenswift_trt.serving.errors import cause_of
from tokenswift_trt.serving.openai_requests import ApiError


class TritonGenerate:
    """Calls to Triton's generate extension for the tokenswift model."""

    def __init__(self, http_url: str, timeout_s: float) -> None:
        self.base = f"http://{http_url}/v2/models/tokenswift"
        self.http_url = http_url
        self.timeout_s = timeout_s

    def _open(self, params: dict[str, Any], stream: bool):
        path = "generate_stream" if stream else "generate"
        body = json.dumps({**params, "stream": stream}).encode()
        request = urllib.request.Request(
            f"{self.base}/{path}", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise _relayed(error.code, error.read()) from None
        except OSError as error:
            raise ApiError(
                f"the inference server at {self.http_url} is unreachable "
                f"({getattr(error, 'reason', error)}): is tritonserver running?",
                status=503,
                kind="server_error",
            ) from None

    def generate(self, params: dict[str, Any]) -> dict[str, Any]:
        with self._open(params, stream=False) as response:
            try:
                data = json.loads(response.read())
            except UPSTREAM_FAULTS as error:
                raise _stopped_answering(error) from None
        if "error" in data:
            raise _relayed(400, json.dumps(data).encode())
        return data

    def stream(self, params: dict[str, Any]) -> tuple[Iterator[dict[str, Any]], Callable[[], None]]:
        """(events, close): the events of generate_stream; close() drops the connection (Triton then
        cancels the request). Errors before the first event raise ApiError here."""
        response = self._open(params, stream=True)

        def events() -> Iterator[dict[str, Any]]:
            with response:
                for line in response:
                    if line.startswith(b"data: "):
                        data = json.loads(line[len(b"data: ") :])
                        if "error" in data:
                            raise _relayed(400, json.dumps(data).encode())
                        yield data

        return events(), response.close


UPSTREAM_FAULTS = (OSError, http.client.HTTPException, ValueError)  # a connection cut, a torn answer


def _stopped_answering(error: Exception) -> ApiError:
    return ApiError(
        f"the inference server stopped answering ({type(error).__name__}: {error}): see its log",
        status=500,
        kind="server_error",
    )


def _relayed(status: int, raw: bytes) -> ApiError:
    """Triton's error for a request as an OpenAI error: a server fault's message names its cause and
    so its status (errors.py: Triton's generate endpoints answer every model error with 400), the other
    4xx are the client's (bad values, named by the request handler), its 5xx the server's."""
    message = raw.decode("utf-8", errors="replace").strip()
    for line in message.splitlines():
        line = line.removeprefix("data: ").strip()
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "error" in data:
            message = str(data["error"])
            break
    cause = cause_of(message)
    if cause is not None:
        return ApiError.server(cause, message)
    if status >= 500:
        return ApiError(message, status=status, kind="server_error")
    return ApiError(message)
