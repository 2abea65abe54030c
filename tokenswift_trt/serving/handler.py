"""Request handling for the Triton model, free of Triton types so that it is testable on its own.

`parse_request` turns named numpy inputs into a `GenerationConfig` (or raises `RequestError` with
a message for the client); `Session.run` generates and streams text increments.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.builder.presets import read_model_defaults
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.journal import (
    JournalError,
    JournalHeld,
    JournalLock,
    JournalWriter,
    check_journal_room,
    check_new_journal,
    journal_header,
    model_identity,
    resume_journal,
)
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.decode.request import (
    SPEED_ONLY,
    config_from,
    manifest_defaults,
    settings_of,
    with_fixed_seed,
)
from tokenswift_trt.decode.scheduler import CANCELLED, FAILED, FINISHED, Scheduler
from tokenswift_trt.decode.scheduler import Request as ScheduledRequest
from tokenswift_trt.decode.stats import Stats
from tokenswift_trt.decode.text import StreamDecoder, TextCodec
from tokenswift_trt.kernels.config import KernelConfig, parse_kernel_settings
from tokenswift_trt.model.engine import Engine, load_engine
from tokenswift_trt.model.engine_dir import MANIFEST
from tokenswift_trt.serving.errors import BUSY, HELD, SHUTTING_DOWN, ServerFault, fault_of
from tokenswift_trt.serving.tp_serve import RankGroup, TensorParallelStopped, tp_config

# Triton request inputs that set generation settings: input name -> (setting, type). Unset ones take
# the engine's defaults (its manifest), then GenerationConfig's; max_tokens is max_new_tokens.
REQUEST_SETTINGS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "eta": ("eta", float),
    "repetition_penalty": ("penalty", float),
    "penalty_window": ("penalty_window", int),
    "ngram_topk": ("ngram_topk", int),
    "seed": ("seed", int),
    "method": ("method", str),
    "ignore_eos": ("ignore_eos", bool),
    "tree": ("tree", str),
    "draft_source": ("draft_source", str),
    "adapt_drafts": ("adapt_drafts", bool),
}

DEFAULT_MAX_QUEUE = 256  # requests an instance keeps waiting for room in its batch before "server busy"


class RequestError(ValueError):
    """A bad request: the message goes back to the client; the server stays up."""


class Cancelled(Exception):
    """The client cancelled or disconnected."""


@dataclass
class Request:
    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool
    journal: Path | None = None  # journal of this request id (journaling enabled)
    done_ids: list[int] = field(default_factory=list)  # tokens generated before a resume
    finished: bool = False  # a resumed journal that had already finished
    lock: JournalLock | None = None  # held while the request runs (journaling enabled)

    def release(self) -> None:
        """Let another request or server take this request id (idempotent)."""
        if self.lock is not None:
            self.lock.release()


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

    def __init__(
        self,
        source: str | Path,
        device: str = "cpu",
        journal_dir: str | Path | None = None,
        memory_budget: int | None = None,
        kernels: str = "",
        tp: int = 1,
        tp_timeout: float = 120.0,
        python: str = "",
        max_batch: int = 0,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ) -> None:
        """`kernels`: kernel settings as NAME=VALUE items joined by `;` (the model's `kernels`
        parameter), over the engine manifest's, else over the defaults. `tp` > 1: this process is rank
        0 of that many tensor-parallel ranks; it starts the others with the interpreter `python`
        (serving/tp_serve.py). `max_batch` >= 1: requests are batched (`start`), `memory_budget` then
        the bytes all their caches share, and at most `max_queue` wait for room (then "server busy")."""
        source = Path(source)
        self.ranks: RankGroup | None = None
        rank = None
        if tp > 1:
            self.ranks = RankGroup(tp, tp_timeout, str(source), device, kernels, python or sys.executable)
            rank = self.ranks.start()
            device = self.ranks.device  # rank 0's: cuda:0 under --device cuda
        settings = parse_kernel_settings(item for item in kernels.split(";") if item.strip())
        # what journals record of the model (resume refuses a journal of another model)
        self.model_name = str(source)
        self.memory_budget = memory_budget  # bytes the caches of one request may use; None = free memory
        self.journal_dir = Path(journal_dir) if journal_dir else None
        if self.journal_dir is not None:
            self.journal_dir.mkdir(parents=True, exist_ok=True)
        if (source / MANIFEST).is_file():
            self.engine, manifest = load_engine_dir(source, device=device, kernels=settings, tp=rank)
            self.codec = TextCodec.from_dir(source / "model")
            self.defaults = manifest_defaults(manifest)
            self.max_length = manifest.max_sequence_length
        else:
            self.engine: Engine = load_engine(
                source, device=device, kernels=KernelConfig().updated(settings), tp=rank
            )
            self.codec = TextCodec.from_dir(source)
            # a model directory prepared from a preset (`make models`) records its sampling settings
            self.defaults: dict[str, Any] = read_model_defaults(source)
            self.max_length = self.engine.config.max_position_embeddings
        # continuous batching (`start`): requests decoded together, up to `max_batch` at once, their
        # caches from one budget (under tensor parallelism every rank's scheduler in lockstep); 0: one
        # request at a time (`run`)
        self.batch = (
            BatchRunner(self.engine, max_batch, memory_budget, max_queue, self.ranks)
            if max_batch >= 1
            else None
        )

    def _journal_path(self, inputs: dict[str, np.ndarray]) -> Path | None:
        request_id = _scalar(inputs, "request_id", str, None)
        if request_id is None:
            return None
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", request_id):
            raise RequestError("request_id must be 1-128 characters of A-Z a-z 0-9 . _ -")
        if self.journal_dir is None:
            raise RequestError("this server keeps no journals: start it with --journal-dir to use request_id")
        return self.journal_dir / f"{request_id}.journal"

    def _lock(self, path: Path) -> JournalLock:
        """The request id's lock; a request id another live server (or request) runs is refused."""
        try:
            return JournalLock(path, holder=f"the server of {self.model_name}")
        except JournalHeld as error:
            raise ServerFault(
                HELD,
                f"request_id {path.stem} is being generated by {error.holder}: wait for it to end, then "
                "resume it with resume=true (or send a new request_id)",
            ) from None
        except JournalError as error:
            raise RequestError(str(error)) from None

    def _resume(self, path: Path, inputs: dict[str, np.ndarray]) -> Request:
        if not path.is_file():
            raise RequestError(f"no journal for this request_id to resume ({path.name})")
        speed = {
            setting: _scalar(inputs, name, kind, None)
            for name, (setting, kind) in REQUEST_SETTINGS.items()
            if setting in SPEED_ONLY
        }
        try:
            model = model_identity(self.engine, self.model_name)
            resumed = resume_journal(path, self.engine.config.eos_token_ids, speed=speed, model=model)
        except JournalError as error:
            raise RequestError(f"cannot resume {path.name}: {error}") from None
        self._check_same(inputs, resumed.prompt_ids, resumed.config)
        return Request(
            resumed.prompt_ids,
            resumed.config,
            _scalar(inputs, "stream", bool, False),
            path,
            resumed.done_ids,
            resumed.finished,
        )

    def _check_same(
        self, inputs: dict[str, np.ndarray], prompt_ids: list[int], config: GenerationConfig
    ) -> None:
        """A resume continues the journal's own request: a field beyond the speed-only ones (tree, n-gram
        k, draft source) may be sent again only with the value the journal holds (a client retrying its
        whole request), never another."""
        changed = []
        if "text_input" in inputs and self.codec.encode(_scalar(inputs, "text_input", str, "")) != prompt_ids:
            changed.append("text_input (another prompt)")
        if "max_tokens" in inputs and _scalar(inputs, "max_tokens", int, 0) != config.max_new_tokens:
            changed.append(f"max_tokens (the journal's is {config.max_new_tokens})")
        recorded = settings_of(config)
        for name, (setting, kind) in REQUEST_SETTINGS.items():
            value = _scalar(inputs, name, kind, None)
            if setting not in SPEED_ONLY and value is not None and value != recorded[setting]:
                changed.append(f"{name} (the journal's is {recorded[setting]!r})")
        if changed:
            raise RequestError(
                f"resume continues the journal's request, which this one changes: {', '.join(changed)}; "
                "send the same values or none of them, or a new request_id to generate afresh"
            )

    def parse(self, inputs: dict[str, np.ndarray]) -> Request:
        """The request of `inputs`; with a request_id it holds that id's lock (`Request.release`)."""
        journal = self._journal_path(inputs)
        if journal is None:
            return self._parse(inputs, None)
        lock = self._lock(journal)
        try:
            request = self._parse(inputs, journal)
        except BaseException:
            lock.release()
            raise
        request.lock = lock
        return request

    def _parse(self, inputs: dict[str, np.ndarray], journal: Path | None) -> Request:
        if _scalar(inputs, "resume", bool, False):
            if journal is None:
                raise RequestError("resume needs the request_id of the interrupted request")
            return self._resume(journal, inputs)
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
        overrides = {
            setting: _scalar(inputs, name, kind, None) for name, (setting, kind) in REQUEST_SETTINGS.items()
        }
        try:
            config = config_from(self.defaults, {**overrides, "max_new_tokens": max_tokens})
        except GenerationError as error:
            raise RequestError(str(error)) from None
        prompt_ids = self.codec.encode(text)
        if len(prompt_ids) + max_tokens > self.max_length:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the engine's "
                f"maximum length {self.max_length}"
            )
        if journal is not None:
            try:  # an unfinished journal of this request_id is never replaced
                check_new_journal(
                    journal, "resume=true", "send a new request_id", label=f"request_id {journal.stem}"
                )
                check_journal_room(journal, max_tokens, len(prompt_ids))
            except JournalError as error:
                raise RequestError(str(error)) from None
            config = with_fixed_seed(config)
        return Request(prompt_ids, config, _scalar(inputs, "stream", bool, False), journal)

    def start(
        self,
        request: Request,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool],
        on_done: Callable[[str, Stats | None, BaseException | None], None],
        on_ids: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`run` batched with the other requests in flight (continuous batching, `BatchRunner`): returns
        at once; `on_text` / `on_ids` are called from the scheduler's thread as tokens commit, and
        `on_done(text, stats, failure)` once the request has ended (failure: None, `Cancelled()`,
        `RequestError` for a request that cannot run as given, or what generation failed with)."""
        assert self.batch is not None, "start() needs a session with batching (max_batch >= 1)"
        generated: list[int] = []

        def collect(ids: list[int]) -> None:
            generated.extend(ids)
            if on_ids is not None:
                on_ids(ids)

        # the scheduler polls `cancelled` before every step: no poll per commit here
        on_tokens, decoder, writer = self._output(request, on_text, collect, None)

        def ended(done: ScheduledRequest) -> None:
            failure = done.failure
            try:
                if writer is not None:
                    writer.close(finished=done.status == FINISHED)
            except JournalError as error:
                failure = failure or fault_of(error)
            finally:
                request.release()
            if done.status == CANCELLED:
                failure = Cancelled()
            elif done.status == FAILED and failure is None:
                failure = fault_of(RuntimeError(done.error or "the scheduler stopped"))
            if isinstance(failure, GenerationError):
                failure = RequestError(str(failure))
            elif isinstance(failure, JournalError):
                failure = fault_of(failure)
            if failure is None:
                rest = decoder.flush()
                if rest:
                    on_text(rest)
            on_done(self.codec.decode(request.done_ids + generated), done.stats, failure)

        if request.finished:
            if writer is not None:
                writer.close(finished=True)
            request.release()
            on_done(self.codec.decode(request.done_ids), Stats(method=request.config.method, seed=0), None)
            return
        try:
            prompt = request.prompt_ids + request.done_ids
            self.batch.submit(prompt, self._remaining(request), on_tokens, cancelled, ended)
        except (GenerationError, ServerFault) as error:
            if writer is not None:
                writer.close(finished=False)
            request.release()
            if isinstance(error, ServerFault):
                raise
            raise RequestError(str(error)) from None

    def _output(
        self,
        request: Request,
        on_text: Callable[[str], None],
        on_ids: Callable[[list[int]], None] | None,
        cancelled: Callable[[], bool] | None,
    ) -> tuple[Callable[[list[int]], None], StreamDecoder, JournalWriter | None]:
        """(the callback that takes the request's committed tokens to its journal, to `on_ids` and, as
        text increments, to `on_text`; its text decoder; its journal writer). The text generated before
        a resume is streamed first. `cancelled`, where given, is asked at every commit."""
        decoder = StreamDecoder(self.codec)
        writer = self._writer(request)

        def on_tokens(ids: list[int]) -> None:
            if cancelled is not None and cancelled():
                raise Cancelled()
            if writer is not None:
                writer.add(ids)
            if on_ids is not None:
                on_ids(ids)
            piece = decoder.push(ids)
            if piece:
                on_text(piece)

        if request.done_ids:
            piece = decoder.push(request.done_ids)
            if piece:
                on_text(piece)
        return on_tokens, decoder, writer

    @staticmethod
    def _remaining(request: Request, **changes: Any) -> GenerationConfig:
        """The request's config for what is left to generate (all of it unless resumed)."""
        remaining = request.config.max_new_tokens - len(request.done_ids)
        return dataclasses.replace(request.config, max_new_tokens=max(1, remaining), **changes)

    def _writer(self, request: Request) -> JournalWriter | None:
        """The request's journal writer (a new journal, or the resumed one), None without a journal."""
        if request.journal is None:
            return None
        header = (
            None
            if request.done_ids or request.finished
            else journal_header(
                request.prompt_ids, request.config, model=model_identity(self.engine, self.model_name)
            )
        )
        return JournalWriter(request.journal, header, every=16)

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()

    def run(
        self,
        request: Request,
        on_text: Callable[[str], None],
        cancelled: Callable[[], bool],
        on_ids: Callable[[list[int]], None] | None = None,
    ) -> tuple[str, Stats]:
        """Generate; `on_text` gets text increments (streaming), `cancelled` is polled every iteration,
        `on_ids` gets each batch of newly generated token ids (before the text they make). One request
        at a time (tensor parallel; `start` batches).

        A resumed request first streams the text generated before the interruption.
        """
        on_tokens, decoder, writer = self._output(request, on_text, on_ids, cancelled)
        stats = Stats(method=request.config.method, seed=request.config.seed or 0)
        completed = False
        try:
            ids: list[int] = []
            if not request.finished:
                config = self._remaining(request, memory_budget=self.memory_budget)
                prompt = request.prompt_ids + request.done_ids
                if self.ranks is not None:  # every rank runs it in step; rank 0 streams and journals
                    ids, stats = self.ranks.run(generate, self.engine, prompt, config, on_tokens)
                else:
                    ids, stats = generate(self.engine, prompt, config, on_tokens=on_tokens)
            completed = True
        except GenerationError as error:
            raise RequestError(str(error)) from None
        finally:
            try:
                if writer is not None:
                    writer.close(finished=completed)
            finally:
                request.release()
        rest = decoder.flush()
        if rest:
            on_text(rest)
        return self.codec.decode(request.done_ids + ids), stats


class BatchRunner:
    """A `Scheduler` stepped by a thread of its own while it holds requests: `submit` queues a request
    (it joins at the next step), and each request's `on_end` is called from that thread once it ends.
    Submissions wait for the step in progress, so requests join between iterations. With `ranks`
    (tensor parallel) the scheduler leads the workers' schedulers in lockstep (serving/tp_serve.py);
    a step that fails leaves the group to be formed again before the next one."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int,
        memory_budget: int | None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        ranks: RankGroup | None = None,
    ) -> None:
        self.ranks = ranks
        self.scheduler = Scheduler(engine, max_batch, memory_budget)
        if ranks is not None:
            self.scheduler.lockstep = ranks.start_batching(max_batch, self.scheduler.memory_budget)
        self.max_queue = max_queue
        self.on_step: Callable[[Scheduler], None] | None = None  # sees the scheduler after each step
        self.ends: dict[int, Callable[[ScheduledRequest], None]] = {}
        self.condition = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="tokenswift-scheduler", daemon=True)
        self.thread.start()

    def submit(
        self,
        prompt: list[int],
        config: GenerationConfig,
        on_tokens: Callable[[list[int]], None],
        cancelled: Callable[[], bool],
        on_end: Callable[[ScheduledRequest], None],
    ) -> None:
        with self.condition:
            if self.closed:
                raise ServerFault(
                    SHUTTING_DOWN, "this request arrived as the server stops: send it to another"
                )
            running, waiting = len(self.scheduler.active), len(self.scheduler.queue)
            if running + waiting >= self.scheduler.max_batch + self.max_queue:
                raise ServerFault(
                    BUSY,
                    f"{running} requests are generating and {waiting} wait, the most this "
                    "instance queues (--max-queue): retry after a while",
                )
            if self.ranks is not None:
                config = tp_config(config, self.ranks.device)
            request = self.scheduler.submit(prompt, config, on_tokens, cancelled)
            self.ends[request.id] = on_end
            self.condition.notify()

    def close(self) -> None:
        with self.condition:
            self.closed = True
            stopped = ServerFault(
                SHUTTING_DOWN,
                "the request was stopped before it finished (with a request_id, its journal keeps what was "
                "generated: resume it with resume=true)",
            )
            self.scheduler.fail_all(str(stopped), stopped)
            self.condition.notify()
        self._report()

    def _loop(self) -> None:
        while True:
            with self.condition:
                while not self.scheduler.pending and not self.closed:
                    self.condition.wait()
                if self.closed:
                    return
                try:
                    if self.ranks is not None and self.ranks.broken:  # a step failed: new workers
                        self.scheduler.lead_new_group(
                            self.ranks.start_batching(self.scheduler.max_batch, self.scheduler.memory_budget)
                        )
                    self.scheduler.step()
                except Exception as error:  # noqa: BLE001 (report it to every request; keep serving)
                    if self.ranks is not None:  # the workers may be gone or out of step
                        self.ranks.broken = True
                        text = str(error).strip()
                        line = text.splitlines()[0] if text else type(error).__name__
                        error = TensorParallelStopped(f"a tensor-parallel rank stopped or timed out: {line}")
                    fault = fault_of(error)
                    self.scheduler.fail_all(str(fault), fault)
                if self.on_step is not None:
                    self.on_step(self.scheduler)
            self._report()

    def _report(self) -> None:
        """Call the ended requests' `on_end` (outside the lock: it sends responses)."""
        with self.condition:
            calls = [(self.ends.pop(r.id), r) for r in self.scheduler.take_ended() if r.id in self.ends]
        for on_end, request in calls:
            on_end(request)
