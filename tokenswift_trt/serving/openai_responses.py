"""OpenAI responses from Triton's answers: a completion object, or the chunks of a stream cut at the
first stop sequence, with the usage and `tokenswift` blocks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tokenswift_trt.serving.errors import FAILED, SHUTTING_DOWN
from tokenswift_trt.serving.openai_requests import (
    INT32_MAX,
    ApiError,
    ServedModel,
    Translated,
    translate_chat,
    translate_completion,
)
from tokenswift_trt.serving.openai_triton import UPSTREAM_FAULTS, TritonGenerate

ABORT = "abort"  # finish_reason of a stream the server cut before its generation finished
STATS = {  # Triton output -> field of the `tokenswift` block
    "acceptance_rate": "acceptance_rate",
    "total_accepted_draft_tokens": "accepted_draft_tokens",
    "total_draft_tokens": "draft_tokens",
    "tokens_per_second": "tokens_per_second",
    "draft_updates": "draft_updates",
}


class StopScanner:
    """Cuts a stream of text before the first stop sequence, holding back a tail that may be the
    beginning of one until the next piece decides."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.hit: str | None = None  # the stop sequence found

    def push(self, piece: str) -> str:
        """The text of `piece` (and of the tail held back before) that is safe to emit."""
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        found = [(self.pending.find(stop), stop) for stop in self.stops if stop in self.pending]
        if found:
            index, self.hit = min(found)
            out, self.pending = self.pending[:index], ""
            return out
        hold = max(
            (k for stop in self.stops for k in range(1, len(stop)) if self.pending.endswith(stop[:k])),
            default=0,
        )
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Outcome:
    """What a generation gave: its text, Triton's final response, the stop sequence that ended it."""

    text: str = ""
    final: dict[str, Any] = field(default_factory=dict)  # empty when a stop sequence ended it
    stop: str | None = None


def _scan(
    request: Translated, events: Iterator[dict[str, Any]], close: Callable[[], None], outcome: Outcome
) -> Iterator[str]:
    """Text pieces of Triton's events, cut at the first stop sequence (the generation is then
    cancelled by closing its connection); fills `outcome`."""
    scanner = StopScanner(request.stop)
    for event in events:
        piece = scanner.push(str(event.get("text_output", "")))
        if piece:
            outcome.text += piece
            yield piece
        if scanner.hit is not None:
            outcome.stop = scanner.hit
            close()
            return
        if any(name in event for name in STATS) or "completion_tokens" in event:
            outcome.final = event
    rest = scanner.flush()
    if rest:
        outcome.text += rest
        yield rest


def _usage(
    model: ServedModel, request: Translated, outcome: Outcome
) -> tuple[dict[str, int], str, dict[str, float]]:
    """(usage block, finish_reason, tokenswift block). Triton's final response gives the counts;
    where a stop sequence cut the generation short there is none, and the completion is the text up
    to the end of the stop sequence, counted with the tokenizer."""
    final = outcome.final
    prompt = int(final.get("prompt_tokens", request.prompt_tokens))
    if "completion_tokens" in final:
        completion = int(final["completion_tokens"])
    else:
        completion = model.text_tokens(outcome.text + (outcome.stop or ""))
    reason = "stop" if outcome.stop is not None else final.get("finish_reason")
    if reason not in ("stop", "length"):
        reason = "length" if completion >= request.params.get("max_tokens", INT32_MAX) else "stop"
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    stats = {name: final[output] for output, name in STATS.items() if output in final}
    return usage, reason, stats


class OpenAIApi:
    """The endpoints, free of HTTP plumbing: each takes a parsed body and answers JSON or SSE events."""

    def __init__(self, model: ServedModel, triton: TritonGenerate) -> None:
        self.model = model
        self.triton = triton
        self.created = int(time.time())
        self.draining = False  # the server is shutting down: new requests are refused, cut streams say so

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "tokenswift-trt",
        }

    def complete(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        request = translate_chat(body, self.model) if chat else translate_completion(body, self.model)
        if request.stream:
            raise ApiError(
                "internal: a streaming request reached complete()", status=500, kind="server_error"
            )
        outcome = Outcome()
        if request.stop:  # streamed from Triton, to cancel the generation at the stop sequence
            events, close = self.triton.stream(request.params)
            try:
                for _ in _scan(request, events, close, outcome):
                    pass
            finally:
                close()
        else:
            outcome.final = self.triton.generate(request.params)
            outcome.text = str(outcome.final.get("text_output", ""))
        text = outcome.text
        usage, reason, stats = _usage(self.model, request, outcome)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model.name,
            "choices": [choice],
            "usage": usage,
            "tokenswift": stats,
        }

    def open_stream(
        self, body: dict[str, Any], chat: bool
    ) -> tuple[Iterator[dict[str, Any]], Callable[[], None]]:
        """(chunks, close) for a streaming request; request errors raise ApiError before any chunk."""
        request = translate_chat(body, self.model) if chat else translate_completion(body, self.model)
        if not request.stream:
            raise ApiError("internal: a non-streaming request reached open_stream()", status=500)
        events, close = self.triton.stream(request.params)
        first = next(events, None)  # Triton's errors for the request come before any text
        events = _chain([first] if first is not None else [], events)
        return self._chunks(request, chat, events, close), close

    def _chunks(
        self,
        request: Translated,
        chat: bool,
        events: Iterator[dict[str, Any]],
        close: Callable[[], None],
    ) -> Iterator[dict[str, Any]]:
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            data = {
                "id": ident,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.model.name,
                "choices": choices,
                **extra,
            }
            if request.include_usage and "usage" not in data:
                data["usage"] = None
            return data

        def piece(text: str, reason: str | None = None) -> dict[str, Any]:
            if chat:
                return {
                    "index": 0,
                    "delta": {"content": text} if text else {},
                    "logprobs": None,
                    "finish_reason": reason,
                }
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if chat:
            yield chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        outcome = Outcome()
        try:
            for text in _scan(request, events, close, outcome):
                yield chunk([piece(text)])
        except UPSTREAM_FAULTS as error:
            yield chunk([piece("", ABORT)])
            raise self._cut(f"{type(error).__name__}: {error}") from None
        except ApiError as error:
            if error.status >= 500:  # the server ended it: a finish reason that says so, then the error
                yield chunk([piece("", ABORT)])
            raise
        if not outcome.final and outcome.stop is None:  # the stream ended without its last response
            yield chunk([piece("", ABORT)])
            raise self._cut("the stream ended before the last response")
        usage, reason, stats = _usage(self.model, request, outcome)
        yield chunk([piece("", reason)], tokenswift=stats)
        if request.include_usage:
            yield chunk([], usage=usage, tokenswift=stats)

    def _cut(self, how: str) -> ApiError:
        """The error of a stream the inference server stopped before its generation finished."""
        if self.draining:
            return ApiError.server(
                SHUTTING_DOWN,
                f"{SHUTTING_DOWN.words}: the generation was stopped before it finished ({how}); send the "
                "request again once the server is back",
            )
        return ApiError.server(
            FAILED, f"{FAILED.words}: the inference server stopped answering ({how}): see its log"
        )


def _chain(first: list[dict[str, Any]], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield from first
    yield from rest
