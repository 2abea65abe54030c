"""Crash-safe journals of long generations, for resuming them token for token.

A journal is a text file of records, one per line: JSON, a tab, then the CRC32 of the JSON
(hex). The first record is the header (prompt ids and every setting that decides the output,
seed included); each later record holds token ids committed since the previous one. Every
append is written and fsync'd before it counts. A torn or corrupt last record (a crash mid-write)
fails its CRC and is ignored, with everything before it intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .decoding import GenerationConfig, GenerationError
from .request import SPEED_ONLY, config_from

FORMAT = "tokenswift-journal/2"  # 2: Gumbel-max sampling with position-keyed noise
EARLIER_SAMPLER_FORMATS = ("tokenswift-journal/1",)  # inverse-CDF sampling: readable, resumable


class JournalError(ValueError):
    """The journal cannot be used (missing, foreign, or its header is damaged)."""


@dataclass
class JournalState:
    header: dict[str, Any]  # {"format", "prompt_ids", "settings": {...}}
    tokens: list[int] = field(default_factory=list)  # generated so far
    finished: bool = False
    dropped_records: int = 0  # torn/corrupt records ignored at the end

    @property
    def earlier_sampler(self) -> bool:
        """Written by a version that sampled differently: a resumed run continues correctly sampled
        text, but not the tokens the original run would have written."""
        return self.header.get("format") in EARLIER_SAMPLER_FORMATS

    def settings(self) -> dict[str, Any]:
        """The header's settings as flat setting names (runtime/request.py)."""
        settings = dict(self.header["settings"])
        return {**settings.pop("sampling"), **settings}

    def config(self) -> GenerationConfig:
        """The generation settings recorded in the header."""
        return config_from({}, self.settings())

    def complete(self, eos_token_ids: Sequence[int]) -> bool:
        """True when nothing is left to generate (finished record, max tokens reached, or EOS)."""
        config = self.config()
        stop = set() if config.ignore_eos else set(eos_token_ids)
        return (
            self.finished
            or len(self.tokens) >= config.max_new_tokens
            or bool(self.tokens and self.tokens[-1] in stop)
        )


def journal_header(
    prompt_ids: Sequence[int], config: GenerationConfig, source: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The header of a new journal: everything that decides the output (the seed must be set)."""
    if config.seed is None:
        raise JournalError("a journal needs a fixed seed to be resumable")
    return {"prompt_ids": list(prompt_ids), "settings": dataclasses.asdict(config), "source": source or {}}


def _line(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":"))
    return f"{payload}\t{zlib.crc32(payload.encode()):08x}\n".encode()


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        payload, crc = line.rstrip(b"\n").rsplit(b"\t", 1)
        if int(crc, 16) != zlib.crc32(payload) or not line.endswith(b"\n"):
            return None
        return json.loads(payload)
    except (ValueError, json.JSONDecodeError):
        return None


class JournalWriter:
    """Appends records with write + fsync; `every` tokens are buffered between records."""

    def __init__(self, path: Path, header: dict[str, Any] | None = None, every: int = 64) -> None:
        self.path = Path(path)
        self.every = every
        self.pending: list[int] = []
        if header is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(self.path.suffix + ".tmp")
            with open(temporary, "wb") as handle:
                handle.write(_line({"format": FORMAT, **header}))
                handle.flush()
                os.fsync(handle.fileno())
            temporary.replace(self.path)  # a journal exists only with a complete header
        self.handle = open(self.path, "ab")

    def _append(self, record: dict[str, Any]) -> None:
        self.handle.write(_line(record))
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def add(self, tokens: list[int]) -> None:
        self.pending.extend(tokens)
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self._append({"tokens": self.pending})
            self.pending = []

    def close(self, finished: bool) -> None:
        self.flush()
        if finished:
            self._append({"finished": True})
        self.handle.close()


def read_journal(path: Path) -> JournalState:
    path = Path(path)
    if not path.is_file():
        raise JournalError(f"journal {path} does not exist")
    lines = path.read_bytes().splitlines(keepends=True)
    header = _parse(lines[0]) if lines else None
    if header is None or header.get("format") not in (FORMAT, *EARLIER_SAMPLER_FORMATS):
        raise JournalError(f"{path} is not a tokenswift journal (or its header is damaged)")
    state = JournalState(header=header)
    for index, line in enumerate(lines[1:], start=1):
        record = _parse(line)
        if record is None:
            state.dropped_records = len(lines) - index
            break
        state.tokens.extend(record.get("tokens", []))
        state.finished = state.finished or bool(record.get("finished"))
    return state


def truncate_to_valid(path: Path) -> None:
    """Cut a torn tail so that new records follow the last valid one."""
    data = Path(path).read_bytes()
    keep = 0
    for line in data.splitlines(keepends=True):
        if _parse(line) is None:
            break
        keep += len(line)
    if keep != len(data):
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())


@dataclass
class Resumption:
    """What continuing a journal needs: the request as recorded, what it wrote, what is left."""

    prompt_ids: list[int]
    done_ids: list[int]  # tokens generated before the interruption
    config: GenerationConfig  # the journal's settings (speed-only ones possibly overridden)
    finished: bool  # nothing is left to generate
    dropped_records: int  # torn records ignored at the end
    earlier_sampler: bool  # see JournalState.earlier_sampler
    source: dict[str, Any]  # where the original run loaded its model from ({} when not recorded)

    def remaining_config(self) -> GenerationConfig:
        """The config of the continuation: the tokens not yet generated."""
        left = max(1, self.config.max_new_tokens - len(self.done_ids))
        return dataclasses.replace(self.config, max_new_tokens=left)


def resume_journal(
    path: Path, eos_token_ids: Sequence[int], speed: Mapping[str, Any] | None = None
) -> Resumption:
    """Read a journal to continue it (the CLI's --resume and the Triton handler's resume=true).

    `speed` may override settings that change only how fast the same tokens come (tree, n-gram k,
    partial cache); a setting that decides the tokens is refused. The journal's torn tail, if any,
    is cut so that new records follow its last valid one.
    """
    state = read_journal(path)
    given = {name: value for name, value in (speed or {}).items() if value is not None}
    deciding = [name for name in given if name not in SPEED_ONLY]
    if deciding:
        raise JournalError(f"a resumed run keeps the journal's own settings: drop {', '.join(deciding)}")
    try:
        config = config_from(state.settings(), given)
    except GenerationError as error:
        raise JournalError(str(error)) from None
    finished = state.complete(eos_token_ids)
    truncate_to_valid(path)
    return Resumption(
        list(state.header["prompt_ids"]),
        list(state.tokens),
        config,
        finished,
        state.dropped_records,
        state.earlier_sampler,
        dict(state.header.get("source") or {}),
    )
