"""Calls to the `tokenswift` model: tritonclient's gRPC streaming API, and over HTTP Triton's generate
extension (`generate`, and `generate_stream` with server-sent events). Triton's HTTP infer API does
not serve decoupled models, so HTTP clients use the generate endpoints."""

from __future__ import annotations

import json
import queue
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TYPES = {  # input name -> (numpy dtype, Triton datatype)
    "text_input": (np.object_, "BYTES"),
    "max_tokens": (np.int32, "INT32"),
    "stream": (np.bool_, "BOOL"),
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "min_p": (np.float32, "FP32"),
    "repetition_penalty": (np.float32, "FP32"),
    "penalty_window": (np.int32, "INT32"),
    "ngram_topk": (np.int32, "INT32"),
    "seed": (np.uint64, "UINT64"),
    "method": (np.object_, "BYTES"),
    "ignore_eos": (np.bool_, "BOOL"),
    "request_id": (np.object_, "BYTES"),
    "resume": (np.bool_, "BOOL"),
    "eta": (np.float32, "FP32"),
    "tree": (np.object_, "BYTES"),
    "draft_source": (np.object_, "BYTES"),
    "adapt_drafts": (np.bool_, "BOOL"),
}
STATS = (
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
    "tokens_per_second",
    "draft_updates",
    "prompt_tokens",
    "completion_tokens",
)


class ClientError(RuntimeError):
    """The server answered with an error."""


@dataclass
class Result:
    text: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    chunks: int = 0
    finish_reason: str = ""  # "stop" (end of sequence) or "length"; set by the final response


def _tensors(module, params: dict[str, Any]) -> list:
    inputs = []
    for name, value in params.items():
        dtype, triton_type = TYPES[name]
        data = np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=dtype)
        tensor = module.InferInput(name, [1], triton_type)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def _collect(
    result: Result, outputs: Callable[[str], np.ndarray | None], on_text: Callable[[str], None] | None
) -> None:
    text = outputs("text_output")
    if text is not None and text.size:
        piece = text.reshape(-1)[0].decode("utf-8")
        result.text += piece
        result.chunks += 1
        if on_text and piece:
            on_text(piece)
    for name in STATS:
        value = outputs(name)
        if value is not None:
            result.stats[name] = float(value.reshape(-1)[0])
    finish = outputs("finish_reason")
    if finish is not None and finish.size:
        item = finish.reshape(-1)[0]
        result.finish_reason = item.decode("utf-8") if isinstance(item, bytes) else str(item)


def grpc_generate(
    url: str,
    params: dict[str, Any],
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
    cancel_after_chunks: int | None = None,
) -> Result:
    """Stream over gRPC (works with and without `stream`); optionally cancel after some chunks."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    result = Result()
    try:
        client.async_stream_infer(
            "tokenswift", _tensors(grpcclient, params), enable_empty_final_response=True
        )
        while True:
            answer, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise ClientError(str(error))
            _collect(result, answer.as_numpy, on_text)
            if cancel_after_chunks is not None and result.chunks >= cancel_after_chunks:
                client.stop_stream(cancel_requests=True)
                return result
            if answer.get_response().parameters.get("triton_final_response").bool_param:
                return result
    finally:
        client.stop_stream()
        client.close()


def generate_endpoint(
    url: str,
    params: dict[str, Any],
    stream: bool,
    on_text: Callable[[str], None] | None = None,
    timeout_s: float = 600.0,
) -> Result:
    """Triton's generate extension: POST /v2/models/tokenswift/generate[_stream] (server-sent events)."""
    path = "generate_stream" if stream else "generate"
    body = json.dumps({**params, "stream": stream}).encode()
    request = urllib.request.Request(
        f"http://{url}/v2/models/tokenswift/{path}", data=body, headers={"Content-Type": "application/json"}
    )
    result = Result()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            events = (
                (line[len(b"data: ") :] for line in response if line.startswith(b"data: "))
                if stream
                else [response.read()]
            )
            for raw in events:
                data = json.loads(raw)
                if "error" in data:
                    raise ClientError(data["error"])
                _collect(
                    result,
                    lambda name, data=data: (
                        None
                        if name not in data
                        else np.array([data[name].encode() if isinstance(data[name], str) else data[name]])
                    ),
                    on_text,
                )
    except urllib.error.HTTPError as error:
        raise ClientError(json.loads(error.read() or b"{}").get("error", str(error))) from None
    return result
