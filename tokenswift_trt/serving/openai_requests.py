"""OpenAI requests as Triton generate requests: the fields each endpoint accepts and how they are
checked, the model's chat template, and the translation of a /v1/completions or /v1/chat/completions
body into the inputs of the `tokenswift` model.

TokenSwift's own settings travel as extra body fields (the openai client's `extra_body`); standard
OpenAI fields this server cannot honour are refused unless they hold their neutral value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.text import TextCodec, TokenizerError
from tokenswift_trt.model.engine_dir import MANIFEST, EngineDirError, read_manifest
from tokenswift_trt.serving.errors import Cause

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # stop sequences per request, as OpenAI allows
ROLES = ("system", "developer", "user", "assistant")  # tool messages need tool calls, not supported

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
