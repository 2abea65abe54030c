"""An OpenAI-compatible HTTP front for the `tokenswift` Triton model.

`/v1/completions`, `/v1/chat/completions` (streaming by server-sent events or not) and `/v1/models`,
served by a stdlib HTTP server next to tritonserver. Each OpenAI request becomes one call to Triton's
generate extension on that server (`generate`, or `generate_stream` when streaming), so it goes
through the same request handler, with the same engine defaults, as a Triton client's request; the
answer is translated back into OpenAI's response, chunk and error objects.

TokenSwift's own settings travel as extra body fields (the openai client's `extra_body`); standard
OpenAI fields this server cannot honour are refused unless they hold their neutral value.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.text import TextCodec, TokenizerError
from tokenswift_trt.model.engine_dir import MANIFEST, EngineDirError, read_manifest
from tokenswift_trt.serving.errors import FAILED, SHUTTING_DOWN, Cause, cause_of

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # stop sequences per request, as OpenAI allows
ROLES = ("system", "developer", "user", "assistant")  # tool messages need tool calls, not supported
ABORT = "abort"  # finish_reason of a stream the server cut before its generation finished

# Fields sent on to Triton under the same name: field -> type. temperature, top_p and seed are
# OpenAI's own; the rest are TokenSwift's extras (the openai client's `extra_body`).
SAMPLING_FIELDS: dict[str, type] = {"temperature": float, "top_p": float, "seed": int}
EXTRA_FIELDS: dict[str, type] = {
    "min_p": float,
    "top_k": int,
    "eta": float,
    "repetition_penalty": float,
    "penalty_window": int,
    "ngram_topk": int,
    "method": str,
    "tree": str,
    "draft_source": str,
    "ignore_eos": bool,
    "adapt_drafts": bool,
    "request_id": str,  # journaled (serve --journal-dir); with resume: true, continues its journal
    "resume": bool,
}
PENALTY_HINT = "use the extra fields repetition_penalty and penalty_window instead"
# Standard fields accepted only at their neutral value (None always passes): field -> (neutral, hint)
NEUTRAL_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "n must be 1: send one request per completion"),
    "best_of": ((1,), "best_of must be 1"),
    "echo": ((False,), "echo is not supported: the prompt is not repeated in the answer"),
    "logprobs": ((False,), "logprobs are not supported"),
    "top_logprobs": ((0,), "top_logprobs are not supported"),
    "presence_penalty": ((0,), f"presence_penalty is not supported: {PENALTY_HINT}"),
    "frequency_penalty": ((0,), f"frequency_penalty is not supported: {PENALTY_HINT}"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "suffix": (("",), "suffix is not supported"),
    "response_format": (({"type": "text"},), "response_format other than text is not supported"),
    "tools": (([],), "tool calls are not supported"),
    "tool_choice": (("none",), "tool calls are not supported"),
    "parallel_tool_calls": ((False,), "tool calls are not supported"),
}
IGNORED_FIELDS = ("user",)  # accepted and not used
COMMON_FIELDS = (
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    *SAMPLING_FIELDS,
    *EXTRA_FIELDS,
    *IGNORED_FIELDS,
    "n",
    "stop",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
)
COMPLETION_FIELDS = frozenset((*COMMON_FIELDS, "prompt", "best_of", "echo", "suffix"))
CHAT_FIELDS = frozenset(
    (
        *COMMON_FIELDS,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
)
STATS = {  # Triton output -> field of the `tokenswift` block
    "acceptance_rate": "acceptance_rate",
    "total_accepted_draft_tokens": "accepted_draft_tokens",
    "total_draft_tokens": "draft_tokens",
    "tokens_per_second": "tokens_per_second",
    "draft_updates": "draft_updates",
}


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind
        self.retry_after_s = retry_after_s  # the Retry-After header, where waiting may help

    @classmethod
    def server(cls, cause: Cause, message: str) -> ApiError:
        """A server fault (errors.py), answered with its status and Retry-After."""
        return cls(
            message, cause.status, code=cause.reason, kind="server_error", retry_after_s=cause.retry_after_s
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class FrontendError(RuntimeError):
    """The front cannot start: model files or the listening address."""


def _strict_type(name: str, value: Any, kind: type) -> Any:
    """`value` checked against `kind` (bool is not a number; ints pass as floats; floats must be finite)."""
    if kind is bool:
        if not isinstance(value, bool):
            raise ApiError(f"{name} must be true or false, got {value!r}", param=name)
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(f"{name} must be an integer, got {value!r}", param=name)
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(f"{name} must be a number, got {value!r}", param=name)
        if not math.isfinite(value):
            raise ApiError(f"{name} must be a finite number, got {value!r}", param=name)
        return float(value)
    if not isinstance(value, str):
        raise ApiError(f"{name} must be a string, got {value!r}", param=name)
    return value


def _int_in(name: str, value: Any, low: int, high: int) -> int:
    value = _strict_type(name, value, int)
    if not low <= value <= high:
        raise ApiError(f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


@dataclass(frozen=True)
class ChatTemplate:
    """A Hugging Face chat template (jinja2), rendered as `apply_chat_template` renders it."""

    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them

    @classmethod
    def from_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The template of a model directory: `chat_template.jinja`, else tokenizer_config.json's
        `chat_template` (a string, or a list of named templates of which "default" is used)."""
        config: dict[str, Any] = {}
        special: dict[str, str] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = model_dir / name
            if not path.is_file():
                continue
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise FrontendError(f"{path} is not valid JSON ({error}): fix or remove it") from None
            if name == "tokenizer_config.json":
                config = data
            for key, value in data.items():
                if key.endswith("_token") and isinstance(value, dict) and "content" in value:
                    value = value["content"]
                if key.endswith("_token") and isinstance(value, str):
                    special[key] = value
        jinja_file = model_dir / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            return None
        template = cls(source, special)
        template._compiled()  # a template that does not compile is the server's problem: say so at start
        return template

    def _compiled(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        try:
            return environment.from_string(self.source)
        except jinja2.exceptions.TemplateError as error:
            raise FrontendError(f"the model's chat template does not compile: {error}") from None

    def render(self, messages: list[dict[str, Any]]) -> str:
        import jinja2

        try:
            return self._compiled().render(
                messages=messages,
                add_generation_prompt=True,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as error:
            raise ApiError(f"the chat template refused these messages: {error}", param="messages") from None


@dataclass(frozen=True)
class ServedModel:
    """What the front needs from the model directory: its name, tokenizer, chat template, length."""

    name: str
    codec: TextCodec
    chat_template: ChatTemplate | None
    max_length: int
    bos_token: str | None  # the BOS the tokenizer adds itself (None: it adds none)

    @classmethod
    def from_dir(cls, path: Path, served_model_name: str | None = None) -> ServedModel:
        path = Path(path)
        try:
            if (path / MANIFEST).is_file():
                files = path / "model"
                max_length = read_manifest(path, verify="none").max_sequence_length
            else:
                files = path
                config = json.loads((path / "config.json").read_text())
                max_length = int(config["max_position_embeddings"])
            codec = TextCodec.from_dir(files)
        except (OSError, KeyError, ValueError, EngineDirError, TokenizerError) as error:
            raise FrontendError(f"cannot read the model files in {path}: {error}") from None
        plain = codec.tokenizer.encode("a", add_special_tokens=False).ids
        special = codec.encode("a")
        added = codec.tokenizer.id_to_token(special[0]) if special[1:] == plain else None
        return cls(
            name=served_model_name or path.resolve().name,
            codec=codec,
            chat_template=ChatTemplate.from_dir(files),
            max_length=max_length,
            bos_token=added,
        )

    def prompt_tokens(self, text: str) -> int:
        """Prompt length as the request handler counts it (the tokenizer's own special tokens added)."""
        return len(self.codec.encode(text))

    def text_tokens(self, text: str) -> int:
        return len(self.codec.tokenizer.encode(text, add_special_tokens=False).ids)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        if self.chat_template is None:
            raise ApiError(
                f"model {self.name} has no chat template (no chat_template in its tokenizer_config.json): "
                "use /v1/completions with a prompt instead",
                param="messages",
            )
        text = self.chat_template.render(messages)
        # the template writes the BOS and the handler's tokenizer adds one too: keep one, as
        # apply_chat_template(tokenize=True) does
        if self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


@dataclass(frozen=True)
class Translated:
    """An OpenAI request as a Triton generate request."""

    params: dict[str, Any]  # inputs of the tokenswift model: text_input, max_tokens, settings
    stream: bool
    include_usage: bool
    prompt_tokens: int  # counted here; Triton's prompt_tokens output replaces it where present
    stop: tuple[str, ...] = ()  # stop sequences: the text ends before the first one generated


def _common(body: dict[str, Any], allowed: frozenset[str], model: ServedModel) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        extras = ", ".join(EXTRA_FIELDS)
        raise ApiError(
            f"unknown field {unknown[0]!r}: neither an OpenAI field this endpoint supports nor one of its "
            f"extras ({extras})",
            param=unknown[0],
        )
    name = body.get("model")
    if name is not None and name != model.name:
        raise ApiError(
            f"the model {name!r} does not exist: this server serves {model.name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    for key, (neutral, hint) in NEUTRAL_FIELDS.items():
        value = body.get(key)
        if value is not None and key in allowed and not any(value == n for n in neutral):
            raise ApiError(f"{hint} (got {key}={value!r})", param=key)
    settings: dict[str, Any] = {}
    for key, kind in {**SAMPLING_FIELDS, **EXTRA_FIELDS}.items():
        value = body.get(key)
        if value is None:
            continue
        if key == "seed":
            settings[key] = _int_in(key, value, 0, UINT64_MAX)
        elif key == "tree" and isinstance(value, int) and not isinstance(value, bool):
            settings[key] = str(value)
        elif kind is int:
            settings[key] = _int_in(key, value, -INT32_MAX - 1, INT32_MAX)
        else:
            settings[key] = _strict_type(key, value, kind)
    return settings


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    stream = False if stream is None else _strict_type("stream", stream, bool)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError('stream_options must be {"include_usage": true|false}', param="stream_options")
    include = options.get("include_usage")
    return stream, False if include is None else _strict_type("stream_options.include_usage", include, bool)


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", param="stop")
    return tuple(s for s in stops if s)


def _max_tokens(body: dict[str, Any], field: str, default: int) -> int:
    value = body.get(field)
    if value is None:
        return default
    value = _strict_type(field, value, int)
    if value <= 0:
        raise ApiError(f"{field} must be positive, got {value}", param=field)
    return min(value, INT32_MAX)


def translate_completion(body: dict[str, Any], model: ServedModel) -> Translated:
    """A /v1/completions body as a Triton generate request; raises ApiError for a bad one."""
    settings = _common(body, COMPLETION_FIELDS, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise ApiError("prompt is required", param="prompt")
    if not isinstance(prompt, str):
        raise ApiError("prompt must be one string (batches and token ids are not supported)", param="prompt")
    stream, include_usage = _streaming(body)
    max_tokens = _max_tokens(body, "max_tokens", DEFAULT_COMPLETION_TOKENS)
    params = _params(prompt, max_tokens, settings, body.get("max_tokens") is not None)
    return Translated(params, stream, include_usage, model.prompt_tokens(prompt), _stops(body))


def _params(prompt: str, max_tokens: int, settings: dict[str, Any], limit_given: bool) -> dict[str, Any]:
    """The Triton inputs; a resume sends no default limit (the journal has its own; one the client
    gives must equal it)."""
    params = {"text_input": prompt, **settings}
    if limit_given or not settings.get("resume"):
        params["max_tokens"] = max_tokens
    return params


def _check_unicode(value: Any, where: str) -> None:
    """Refuse a string holding a lone surrogate (JSON's "\\ud800" parses, but is no text to encode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ApiError(
                f"{where} is not valid Unicode (a lone surrogate at character {error.start}): "
                "send UTF-8 text",
                param=where.split(".")[0].split("[")[0],
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, f"{where}[{index}]")


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(f'{where} must be an object with a "role" string', param="messages")
    if message["role"] not in ROLES:
        raise ApiError(
            f"{where}.role must be one of {', '.join(ROLES)}, got {message['role']!r}", param="messages"
        )
    if message.get("content") is None:
        raise ApiError(f"{where}.content is required (a string or a list of text parts)", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(f"{where}.content: only text parts are supported", param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string or a list of text parts", param="messages")
    return {**message, "content": content}


def translate_chat(body: dict[str, Any], model: ServedModel) -> Translated:
    """A /v1/chat/completions body as a Triton generate request (prompt from the chat template)."""
    settings = _common(body, CHAT_FIELDS, model)
    messages = body.get("messages")
    if messages is None:
        raise ApiError("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    prompt = model.chat_prompt([_message(i, message) for i, message in enumerate(messages)])
    stream, include_usage = _streaming(body)
    prompt_tokens = model.prompt_tokens(prompt)
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # OpenAI's chat default is "as long as the model allows"
    max_tokens = _max_tokens(body, limit_field, max(1, model.max_length - prompt_tokens))
    params = _params(prompt, max_tokens, settings, body.get(limit_field) is not None)
    return Translated(params, stream, include_usage, prompt_tokens, _stops(body))


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a burst of clients waits instead of being reset

    def __init__(self, address: tuple[str, int], api: OpenAIApi) -> None:
        self.api = api
        self.active = 0  # requests being answered
        self.idle = threading.Condition()
        super().__init__(address, _Handler)

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        with self.idle:
            self.active += 1
        try:
            yield
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.active == 0, timeout=timeout_s)


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
