"""Request handling for the Triton model, free of Triton types so that it is testable on its own.

`parse_request` turns named numpy inputs into a `GenerationConfig` (or raises `RequestError` with
a message for the client); `Session.run` generates and streams text increments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenswift_trt.runtime.decoding import GenerationConfig, GenerationError, Stats, generate
from tokenswift_trt.runtime.engine import Engine, load_engine
from tokenswift_trt.runtime.engine_dir import MANIFEST, load_engine_dir
from tokenswift_trt.runtime.sampling import SamplingConfig
from tokenswift_trt.runtime.text import StreamDecoder, TextCodec


class RequestError(ValueError):
    """A bad request: the message goes back to the client; the server stays up."""


class Cancelled(Exception):
    """The client cancelled or disconnected."""


@dataclass
class Request:
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool


def _scalar(inputs: dict[str, np.ndarray], name: str, kind: type, default: Any) -> Any:
    value = inputs.get(name)
    if value is None:
        return default
    if value.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got {value.size}")
    item = value.reshape(-1)[0]
    if kind is str:
        if not isinstance(item, bytes | str):
            raise RequestError(f"{name} must be a string")
        try:
            return item.decode("utf-8") if isinstance(item, bytes) else item
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8") from None
    return kind(item)


class Session:
    """A loaded engine and tokenizer, with the engine's sampling defaults."""

    def __init__(self, source: str | Path, device: str = "cpu") -> None:
        source = Path(source)
        if (source / MANIFEST).is_file():
            self.engine, manifest = load_engine_dir(source, device=device)
            self.codec = TextCodec.from_dir(source / "model")
            self.defaults = dict(manifest.sampling, tree=manifest.tree)
            self.max_length = manifest.max_sequence_length
        else:
            self.engine: Engine = load_engine(source, device=device)
            self.codec = TextCodec.from_dir(source)
            self.defaults = {}
            self.max_length = self.engine.config.max_position_embeddings

    def parse(self, inputs: dict[str, np.ndarray]) -> Request:
        if "text_input" not in inputs:
            raise RequestError("text_input is required")
        text = _scalar(inputs, "text_input", str, "")
        if not text.strip():
            raise RequestError("text_input is empty")
        if "max_tokens" not in inputs:
            raise RequestError("max_tokens is required")
        max_tokens = _scalar(inputs, "max_tokens", int, 0)
        if max_tokens <= 0:
            raise RequestError(f"max_tokens must be positive, got {max_tokens}")
        d = self.defaults
        sampling = SamplingConfig(
            temperature=_scalar(inputs, "temperature", float, d.get("temperature", 1.0)),
            top_k=_scalar(inputs, "top_k", int, 0),
            top_p=_scalar(inputs, "top_p", float, d.get("top_p", 1.0)),
            min_p=_scalar(inputs, "min_p", float, d.get("min_p", 0.0)),
            penalty=_scalar(inputs, "repetition_penalty", float, d.get("penalty", 1.0)),
            penalty_window=_scalar(inputs, "penalty_window", int, d.get("penalty_window", 1024)),
        )
        config = GenerationConfig(
            max_new_tokens=max_tokens,
            method=_scalar(inputs, "method", str, "tokenswift"),
            sampling=sampling,
            tree=d.get("tree", "1,3,3,3"),
            ngram_topk=_scalar(inputs, "ngram_topk", int, d.get("ngram_topk", 20)),
            kv_budget=d.get("kv_budget", 4096),
            seed=_scalar(inputs, "seed", int, None),
            ignore_eos=_scalar(inputs, "ignore_eos", bool, False),
            max_length=self.max_length,
        )
        try:
            config.validate()
        except GenerationError as error:
            raise RequestError(str(error)) from None
        prompt_ids = self.codec.encode(text)
        if len(prompt_ids) + max_tokens > self.max_length:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's maximum length {self.max_length}"
            )
        return Request(prompt_ids, config, _scalar(inputs, "stream", bool, False))

    def run(self, request: Request, on_text: Callable[[str], None], cancelled: Callable[[], bool]) -> tuple[str, Stats]:
        """Generate; `on_text` gets text increments (streaming), `cancelled` is polled every iteration."""
        decoder = StreamDecoder(self.codec)

        def on_tokens(ids: list[int]) -> None:
            if cancelled():
                raise Cancelled()
            piece = decoder.push(ids)
            if piece:
                on_text(piece)

        try:
            ids, stats = generate(self.engine, request.prompt_ids, request.config, on_tokens=on_tokens)
        except GenerationError as error:
            raise RequestError(str(error)) from None
        rest = decoder.flush()
        if rest:
            on_text(rest)
        return self.codec.decode(ids), stats
