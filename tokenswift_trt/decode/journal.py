"""Crash-safe journals of long generations, for resuming them token for token.

A journal is a text file of records, one per line: JSON, a tab, then the CRC32 of the JSON
(hex). The first record is the header (prompt ids, every setting that decides the output, seed
included, and the model that writes it); each later record holds token ids committed since the
previous one, and a last record marks the generation finished. A new journal never replaces one
whose generation is unfinished (`check_new_journal`). Every append is written and fsync'd before
it counts. A torn or corrupt last record (a crash mid-write) fails its CRC and is ignored, with
everything before it intact.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import resource
import shutil
import socket
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.request import SPEED_ONLY, config_from
from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
from tokenswift_trt.model.engine import Engine

BYTES_PER_TOKEN = 8  # a token id as the journal writes it (digits, a comma), with its record's share
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
        """The header's settings as flat setting names (decode/request.py)."""
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


def model_identity(engine: Engine, name: str) -> dict[str, Any]:
    """What a journal records of the model that writes it: `name` (where it was loaded from, for
    messages), its vocabulary size, dtype, fingerprint (`engine.model_fingerprint`) and kernel settings
    (kernels/config.py)."""
    return {
        "name": name,
        "vocab_size": engine.config.vocab_size,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "fingerprint": engine.fingerprint,
        "kernels": engine.kernels.to_dict(),
    }


def recorded_kernels(state: JournalState) -> dict[str, Any] | None:
    """The kernel settings of the engine that wrote a journal (None: not recorded)."""
    kernels = (state.header.get("model") or {}).get("kernels")
    return dict(kernels) if isinstance(kernels, dict) else None


def check_kernels(path: Path, recorded: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> None:
    """Refuse to continue a journal under output-deciding kernel settings other than those that wrote
    it (another kernel rounds differently, so the tokens could differ). A journal from before kernel
    settings were recorded is not checked."""
    if recorded is None or current is None:
        return
    try:
        before = KernelConfig.from_dict(recorded).output_deciding()
    except KernelConfigError as error:
        raise JournalError(f"{path} records kernel settings this version cannot read ({error})") from None
    now = KernelConfig.from_dict(current).output_deciding()
    changed = [name for name in before if before[name] != now[name]]
    if changed:
        wanted = " ".join(f"--kernel {name}={_setting_text(before[name])}" for name in changed)
        running = ", ".join(f"{name}={_setting_text(now[name])}" for name in changed)
        raise JournalError(
            f"{path} was written with other output-deciding kernel settings than this engine's ({running}): "
            f"resume it with {wanted}"
        )


def _setting_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def journal_header(
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    source: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The header of a new journal: everything that decides the output (the seed must be set) and,
    given, the model that writes it (`model_identity`)."""
    if config.seed is None:
        raise JournalError("a journal needs a fixed seed to be resumable")
    settings = {**dataclasses.asdict(config), "tree": str(config.tree)}  # the tree in its text form
    header = {"prompt_ids": list(prompt_ids), "settings": settings, "source": source or {}}
    if model is not None:
        header["model"] = dict(model)
    return header


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
            temporary = _temporary(self.path)
            try:
                if self.path.is_dir():
                    raise IsADirectoryError(21, "is a directory")
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(temporary, "wb") as handle:
                    handle.write(_line({"format": FORMAT, **header}))
                    handle.flush()
                    os.fsync(handle.fileno())
                temporary.replace(self.path)  # a journal exists only with a complete header
            except OSError as error:
                try:
                    temporary.unlink(missing_ok=True)
                except OSError:
                    pass
                raise _unwritable(self.path, error) from None
        try:
            self.handle = open(self.path, "ab")
        except OSError as error:
            raise _unwritable(self.path, error) from None

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self.handle.write(_line(record))
            self.handle.flush()
            os.fsync(self.handle.fileno())
        except OSError as error:  # a full disk or a file size limit: what was written before stays valid
            reason = error.strerror or type(error).__name__
            raise JournalError(
                f"cannot write the journal {self.path} ({reason}): it keeps the tokens committed before "
                "this; free space on its disk and resume it"
            ) from None

    def add(self, tokens: list[int]) -> None:
        self.pending.extend(tokens)
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self._append({"tokens": self.pending})
            self.pending = []

    def close(self, finished: bool) -> None:
        try:
            self.flush()
            if finished:
                self._append({"finished": True})
        finally:
            try:
                self.handle.close()
            except OSError:  # the failed write above already says why
                pass


def _temporary(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".tmp")


def _unwritable(path: Path, error: OSError) -> JournalError:
    if path.is_dir():
        return JournalError(f"journal {path} is a directory: name a file, e.g. {path / 'run.journal'}")
    reason = error.strerror or type(error).__name__
    blocking = next((parent for parent in path.parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        reason = f"{blocking} is a file, not a directory"
    return JournalError(f"cannot write the journal {path} ({reason}): choose a path you can write to")


def unfinished_journal(path: Path) -> JournalState | None:
    """The journal at `path` when it holds a generation that can still be resumed (no finished record,
    fewer tokens than it asked for), else None (no such file, a finished journal, or not a journal)."""
    try:
        state = read_journal(path)
        wanted = int(state.header["settings"]["max_new_tokens"])
    except (JournalError, KeyError, TypeError, ValueError, OSError):
        return None
    return None if state.finished or len(state.tokens) >= wanted else state


def check_new_journal(path: Path, resume_with: str, start_over: str, label: str | None = None) -> None:
    """Refuse, before anything runs, a path where a new journal would destroy work or cannot be written:
    an unfinished journal (`resume_with` says how to continue it, `start_over` how to start afresh),
    another file that is not a journal, a directory, a place that cannot be written (probed with a
    temporary file, removed). A finished journal may be replaced."""
    path = Path(path)
    label = label or str(path)
    state = unfinished_journal(path)
    if state is not None:
        wanted = state.header["settings"]["max_new_tokens"]
        raise JournalError(
            f"{label} holds an unfinished generation ({len(state.tokens)} of {wanted} tokens): continue it "
            f"with {resume_with}, or {start_over} to start over"
        )
    if path.is_dir():
        raise JournalError(f"journal {label} is a directory: name a file, e.g. {path / 'run.journal'}")
    if path.is_file() and path.stat().st_size and not _is_journal(path):
        raise JournalError(f"{label} exists and is not a tokenswift journal: choose another path")
    # the directory that exists (the writer creates the rest) must take a file: probe it, leaving nothing
    existing = next(parent for parent in path.parents if parent.exists())
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".tokenswift-journal-"):
            pass
    except OSError as error:
        raise _unwritable(path, error) from None


def check_journal_room(path: Path, max_new_tokens: int, prompt_tokens: int = 0) -> None:
    """Refuse, before generation starts, a journal that the disk (free space) or the process's file
    size limit (`ulimit -f`) cannot hold to the end."""
    need = (max_new_tokens + prompt_tokens) * BYTES_PER_TOKEN + 4096
    existing = next(parent for parent in Path(path).parents if parent.exists())
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if free < need:
        raise JournalError(
            f"the disk of {existing} has {_size(free)} free and the journal {path} needs about {_size(need)} "
            f"for {max_new_tokens} tokens: free space there or journal elsewhere"
        )
    if limit != resource.RLIM_INFINITY and limit < need:
        raise JournalError(
            f"this process may write files of at most {_size(limit)} (ulimit -f) and the journal {path} "
            f"needs about {_size(need)} for {max_new_tokens} tokens: raise the limit or ask for fewer tokens"
        )


def _size(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB" if count >= 1 << 20 else f"{count} bytes"


class JournalLock:
    """Who runs a journal's request now: an exclusive `flock` on `<journal>.lock`, which names its
    holder (process, host, since when). The lock ends with its holder, even one killed with SIGKILL;
    the small lock file stays beside the journal."""

    def __init__(self, path: Path, holder: str) -> None:
        self.path = Path(str(path) + ".lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle: Any = open(self.path, "a+")
        except OSError as error:
            raise _unwritable(Path(path), error) from None
        try:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.handle.seek(0)
            recorded = self.handle.read().strip()
            self.handle.close()
            self.handle = None
            raise JournalHeld(Path(path), _holder_text(recorded)) from None
        identity = {"holder": holder, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(json.dumps(identity))
        self.handle.flush()

    def release(self) -> None:
        """Let others take the journal (idempotent)."""
        if self.handle is not None:
            self.handle.close()  # closing the descriptor drops the flock
            self.handle = None


class JournalHeld(JournalError):
    """Another live process runs the request of this journal."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path.name} is being generated by {holder}")
        self.holder = holder


def _holder_text(recorded: str) -> str:
    try:
        identity = json.loads(recorded)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(identity["since"])))
        here = identity["host"] == socket.gethostname() and identity["pid"] == os.getpid()
        where = (
            "this server" if here else f"{identity['holder']} (pid {identity['pid']} on {identity['host']})"
        )
        return f"{where} since {since}"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _is_journal(path: Path) -> bool:
    try:
        read_journal(path)
    except (JournalError, OSError):
        return False
    return True


def read_journal(path: Path) -> JournalState:
    path = Path(path)
    if path.is_dir():
        raise JournalError(f"journal {path} is a directory: give the journal file")
    if not path.is_file():
        raise JournalError(f"journal {path} does not exist")
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except OSError as error:
        raise JournalError(f"cannot read journal {path} ({error.strerror or type(error).__name__})") from None
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


def _describe(model: Mapping[str, Any]) -> str:
    return (
        f"{model.get('name') or 'a model'} (vocabulary {model.get('vocab_size')}, {model.get('dtype')}, "
        f"fingerprint {model.get('fingerprint') or 'unknown'})"
    )


def check_model(path: Path, state: JournalState, model: Mapping[str, Any]) -> None:
    """Refuse to continue a journal with another model than the one that wrote it (`model_identity`).
    A journal from before models were recorded is checked as far as it can be: its token ids must
    lie in this model's vocabulary."""
    recorded = state.header.get("model")
    if recorded:
        fingerprints = recorded.get("fingerprint"), model.get("fingerprint")
        other = all(fingerprints) and fingerprints[0] != fingerprints[1]  # "" = not known
        if recorded.get("vocab_size") != model["vocab_size"] or other:
            raise JournalError(
                f"{path} was written by {_describe(recorded)}, not by this model, {_describe(model)}: "
                "resume it with the model that wrote it"
            )
        if recorded.get("dtype") != model["dtype"]:
            raise JournalError(
                f"{path} was written by a {recorded.get('dtype')} engine, this one runs {model['dtype']}: "
                f"resume it in {recorded.get('dtype')} (--dtype {recorded.get('dtype')}) to continue the "
                "same tokens"
            )
        check_kernels(path, recorded.get("kernels"), model.get("kernels"))
        return
    ids = [*state.header.get("prompt_ids", []), *state.tokens]
    if ids and max(ids) >= model["vocab_size"]:
        raise JournalError(
            f"{path} holds token id {max(ids)}, outside this model's vocabulary of {model['vocab_size']}: it "
            "was written by another model; resume it with that one"
        )


def resume_journal(
    path: Path,
    eos_token_ids: Sequence[int],
    speed: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
) -> Resumption:
    """Read a journal to continue it (the CLI's --resume and the Triton handler's resume=true).

    `speed` may override settings that change only how fast the same tokens come (tree, n-gram k,
    partial cache); a setting that decides the tokens is refused. Given `model` (`model_identity` of
    the engine that would continue it), a journal written by another model is refused. The journal's
    torn tail, if any, is cut so that new records follow its last valid one.
    """
    state = read_journal(path)
    if model is not None:
        check_model(Path(path), state, model)
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
