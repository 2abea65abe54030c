"""Text <-> token ids with a model directory's `tokenizer.json`, and incremental decoding for streams."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer."""


class TextCodec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextCodec:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {model_dir}: copy the checkpoint's tokenizer files there"
            )
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StreamDecoder:
    """Turns a growing list of ids into text increments, holding back incomplete UTF-8 sequences."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else text
        self.emitted = text
        return piece

    def flush(self) -> str:
        text = self.codec.decode(self.ids)
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
