"""Many prompts at once: the offline "generate N long answers" job, batched in one model instance.

    import tokenswift_trt as ts
    model = ts.load("smollm2-135m")
    results = ts.generate_batch(model, ["It is a truth", "Call me Ishmael"], 1024, seed=1, max_batch=8)

`generate_batch` submits every prompt to a `decode.scheduler.Scheduler` and returns one `Result` per
prompt, in order; each request's tokens are those of its run alone (`ts.generate` with the same
settings). `run_batch` is the journaled form the CLI's `batch` command runs: every request keeps a
journal in `journal_dir`, finished results are appended to a JSONL file as they finish, and a run that
was killed starts again where it stopped (finished requests are skipped, unfinished ones resume from
their journals token for token).

Past one process, `torchrun` runs the same command on every rank (on one node or many): rank r takes
every size-th request from the r-th (`Shard`), writes its results to a file of its own beside the
output, and once all ranks are done, rank 0 folds those files into the output (`merge_shards`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenswift_trt.api import ApiError, Model, Result, Run, _first_line, resume_run, start_run
from tokenswift_trt.decode.config import GenerationError
from tokenswift_trt.decode.journal import JournalError, read_journal
from tokenswift_trt.decode.request import config_from
from tokenswift_trt.decode.scheduler import FINISHED, Request, Scheduler

MAX_BATCH = 8  # requests decoded at once by default


@dataclass(frozen=True)
class Shard:
    """This process's part of a batch run over `size` processes (torchrun ranks): every `size`-th
    request, from the `rank`-th."""

    rank: int = 0
    size: int = 1

    def take(self, items: Sequence[BatchItem]) -> list[BatchItem]:
        return [item for index, item in enumerate(items) if index % self.size == self.rank]

    def results(self, output: Path) -> Path:
        """Where this rank writes its results (the output itself for one process)."""
        if self.size == 1:
            return output
        return output.with_name(f"{output.name}.rank{self.rank}-of-{self.size}")


def shard_files(output: Path) -> list[Path]:
    """The per-rank result files of `output` not yet merged (from a run of any size)."""
    return sorted(output.parent.glob(f"{glob.escape(output.name)}.rank*-of-*"))


def finished_ids(output: Path) -> set[str]:
    """Ids with a result in `output` or in a rank's file of it."""
    found = done_ids(output)
    for path in shard_files(output):
        found |= done_ids(path)
    return found


def merge_shards(output: Path, items: Sequence[BatchItem]) -> int:
    """Append the ranks' results to `output` (in the requests' order; ids it holds already are skipped)
    and remove the rank files once the output is on disk. Returns how many results were added. A merge
    killed halfway is done again by the next run."""
    found: dict[str, str] = {}
    for path in shard_files(output):
        done_ids(path)  # cuts a torn last line
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                found[str(json.loads(line)["id"])] = line
    present = done_ids(output)
    order = {item.id: index for index, item in enumerate(items)}
    new = sorted((i for i in found if i not in present), key=lambda i: order.get(i, len(order)))
    if new:
        with open(output, "a", encoding="utf-8") as handle:
            handle.write("".join(found[i] + "\n" for i in new))
            handle.flush()
            os.fsync(handle.fileno())
    for path in shard_files(output):
        path.unlink()
    return len(new)


@dataclass
class BatchItem:
    """One request of a batch: its id (the results' key), prompt and settings (decode/request.py)."""

    id: str
    prompt: str | list[int]
    settings: dict[str, Any] = field(default_factory=dict)  # max_new_tokens among them


def read_requests(path: Path, defaults: Mapping[str, Any] | None = None) -> list[BatchItem]:
    """Requests from a file: JSON Lines (`{"id": ..., "prompt": ..., "max_new_tokens": ..., <settings>}`;
    `max_tokens` is taken for `max_new_tokens`, a missing id is the line's number) or plain text (one
    prompt per line). `defaults` fill settings a line leaves out. Raises ApiError naming the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ApiError(f"cannot read the requests file {path}: {_first_line(error)}") from None
    items: list[BatchItem] = []
    jsonl = path.suffix in (".jsonl", ".json") or any(line.lstrip().startswith("{") for line in lines[:1])
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            items.append(BatchItem(str(number), line, dict(defaults or {})))
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ApiError(
                f"{path}:{number} is not JSON ({_first_line(error)}): one request object per line"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), (str, list)):
            raise ApiError(f'{path}:{number}: each line needs a "prompt" (text or token ids)')
        record = dict(record)
        identifier = str(record.pop("id", number))
        prompt = record.pop("prompt")
        if "max_tokens" in record:
            record["max_new_tokens"] = record.pop("max_tokens")
        items.append(BatchItem(identifier, prompt, {**(defaults or {}), **record}))
    identifiers = [item.id for item in items]
    if len(set(identifiers)) != len(identifiers):
        repeated = sorted({i for i in identifiers if identifiers.count(i) > 1})
        raise ApiError(f"request ids must be unique in {path}; repeated: {', '.join(repeated[:5])}")
    if not items:
        raise ApiError(f"{path} holds no requests")
    return items


def generate_batch(
    model: Model,
    prompts: Sequence[str | list[int]],
    max_new_tokens: int,
    *,
    max_batch: int = MAX_BATCH,
    memory_budget: int | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    **settings: Any,
) -> list[Result]:
    """Generate after every prompt with one batched scheduler; `settings` as `ts.generate`'s, the same
    for each. `on_tokens(index, ids)` streams each request's tokens as they commit. Returns one Result
    per prompt in order; raises ApiError for a request that failed."""
    items = [
        BatchItem(str(i), p, {**settings, "max_new_tokens": max_new_tokens}) for i, p in enumerate(prompts)
    ]
    results: dict[str, Result] = {}
    errors: dict[str, str] = {}
    streams = (
        None
        if on_tokens is None
        else {item.id: (lambda ids, i=index: on_tokens(i, ids)) for index, item in enumerate(items)}
    )
    run_batch(
        model, items, results.__setitem__, errors.__setitem__, max_batch, memory_budget, streams=streams
    )
    if errors:
        identifier, message = next(iter(errors.items()))
        raise ApiError(f"request {identifier} failed: {message}")
    return [results[item.id] for item in items]


def run_batch(
    model: Model,
    items: Sequence[BatchItem],
    on_result: Callable[[str, Result], None],
    on_error: Callable[[str, str], None],
    max_batch: int = MAX_BATCH,
    memory_budget: int | None = None,
    journal_dir: Path | None = None,
    streams: Mapping[str, Callable[[list[int]], None]] | None = None,
    on_step: Callable[[Scheduler], None] | None = None,
) -> Scheduler:
    """Run `items` through one scheduler; each finished request goes to `on_result(id, Result)` (a
    failed one to `on_error(id, message)`) as it ends. With `journal_dir`, request ID keeps the journal
    `ID.journal` there: an unfinished one is resumed, token for token, instead of started again.
    `on_step` sees the scheduler after every step (progress)."""
    scheduler = Scheduler(model.engine, max_batch, memory_budget)
    runs: dict[int, tuple[BatchItem, Run]] = {}
    for item in items:
        try:
            run = _prepare(model, item, journal_dir)
        except ApiError as error:
            on_error(item.id, str(error))
            continue
        if run.finished:
            on_result(item.id, Result(run.done_ids, model.codec.decode(run.done_ids), None))
            continue
        writer = run.writer
        stream = (streams or {}).get(item.id)

        def committed(ids: list[int], writer=writer, stream=stream) -> None:
            if writer is not None:
                writer.add(ids)
            if stream is not None:
                stream(ids)

        try:
            request = scheduler.submit(run.prompt_ids + run.done_ids, run.remaining, committed)
        except GenerationError as error:
            if writer is not None:
                writer.close(finished=False)
            on_error(item.id, _first_line(error))
            continue
        runs[request.id] = (item, run)
    while scheduler.pending:
        scheduler.step()
        _report(model, runs, scheduler, on_result, on_error)
        if on_step is not None:
            on_step(scheduler)
    _report(model, runs, scheduler, on_result, on_error)  # ended at submission or admission
    return scheduler


def _report(
    model: Model,
    runs: Mapping[int, tuple[BatchItem, Run]],
    scheduler: Scheduler,
    on_result: Callable[[str, Result], None],
    on_error: Callable[[str, str], None],
) -> None:
    """Each request that ended since the last report, to `on_result` or `on_error`."""
    for request in scheduler.take_ended():
        item, run = runs[request.id]
        _finish(model, item, run, request, on_result, on_error)


def _prepare(model: Model, item: BatchItem, journal_dir: Path | None) -> Run:
    """The request's run: resumed from its journal where one is unfinished, else new."""
    journal = None if journal_dir is None else journal_dir / f"{_safe(item.id)}.journal"
    if journal is not None and journal.is_file():
        try:
            unfinished = not read_journal(journal).finished
        except JournalError:
            unfinished = False
        if unfinished:
            return resume_run(journal, model)
        journal.unlink()  # a finished journal whose result was lost: run the request again
    try:
        config = config_from(model.defaults, item.settings)
    except (GenerationError, ValueError, TypeError) as error:
        raise ApiError(_first_line(error)) from None
    return start_run(model, item.prompt, config, journal)


def _finish(
    model: Model,
    item: BatchItem,
    run: Run,
    request: Request,
    on_result: Callable[[str, Result], None],
    on_error: Callable[[str, str], None],
) -> None:
    if run.writer is not None:
        try:
            run.writer.close(finished=request.status == FINISHED)
        except JournalError as error:  # a full disk: this request fails, its journal keeps what it had
            on_error(item.id, _first_line(error))
            return
    if request.status != FINISHED:
        on_error(item.id, request.error or request.status)
        return
    ids = run.done_ids + request.tokens
    on_result(item.id, Result(ids, model.codec.decode(ids), request.stats))


def _safe(identifier: str) -> str:
    """A request id as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in identifier) or "_"


def done_ids(path: Path) -> set[str]:
    """Ids already in a results file (JSON Lines); a torn last line (a killed run) is cut off."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(end)
    identifiers = set()
    for line in data[:end].decode("utf-8").splitlines():
        if line.strip():
            identifiers.add(str(json.loads(line)["id"]))
    return identifiers


def append_line(path: Path, record: dict) -> None:
    """One result line, flushed to disk before the next request's result is written."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
