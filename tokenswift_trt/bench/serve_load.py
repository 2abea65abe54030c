"""A bounded load test of a `tokenswift` server: throughput and latency under load, then leak checks.

Phase 1 (`load`): `streams` long gRPC streams (`stream_tokens` each, EOS ignored, distinct seeds) and,
at the same time, `short_requests` short HTTP `generate_stream` requests (`short_tokens` each) sent by
`short_workers` clients one after another. Reported: generated tokens per second over the phase, and
per request, measured at the client, the time to first token, the time per output token after the
first and the request's duration.

Phase 2 (`mixed`): `mixed_requests` bounded requests (`mixed_tokens` each) sent by `mixed_workers`
clients: normal completions (gRPC streams and HTTP `generate`), gRPC streams cancelled after a few
chunks, HTTP `generate_stream` clients that read a few events and close their socket, and bad requests
(some refused by the HTTP front before Triton, some by the model).

Before phase 1, after phase 1 and after phase 2 (each once the server is idle, plus `settle_s`), the
server's memory is read: the resident memory of tritonserver and every process it started (the
Python-backend stubs) and the /dev/shm regions they map. The metrics port is scraped at the same
moments. The checks: every request got the answer its kind expects; every request that reached the
model is counted once in `tokenswift:request_success_total` (ok + error + cancelled); phase 1's
generated tokens counted by the server equal the tokens the clients received; no request is pending;
resident and shared memory after phase 2 are within `memory_tolerance_mib` of after phase 1.

The counters are read as differences, so a target server must have no other traffic during the run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import random
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenswift_trt.serving.client import ClientError, Result, generate_endpoint, grpc_generate

from .report import write_csv

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
MODEL = "tokenswift"
OUTCOMES = ("ok", "error", "cancelled")
PENDING = "nv_inference_pending_request_count"


class LoadError(RuntimeError):
    """The load test cannot run (no server, no psutil, a server that stops answering)."""


@dataclass(frozen=True)
class LoadConfig:
    streams: int = 8  # phase 1: concurrent long gRPC streams
    stream_tokens: int = 512
    short_requests: int = 16  # phase 1: short HTTP generate_stream requests alongside the streams
    short_tokens: int = 16
    short_workers: int = 4  # clients sending the short requests, one after another each
    mixed_requests: int = 100  # phase 2
    mixed_tokens: int = 64
    mixed_workers: int = 4
    cancel_after_chunks: int = 2  # a cancelling gRPC client stops after this many text chunks
    disconnect_after_events: int = 3  # a disconnecting HTTP client closes after this many events
    memory_tolerance_mib: float = 64.0  # allowed growth of RSS and of /dev/shm from phase 1 to phase 2
    settle_s: float = 2.0  # wait once the server is idle, before memory is read
    warmup_tokens: int = 16  # one request before phase 1 (first-request setup), outside the figures
    idle_timeout_s: float = 120.0  # longest wait for the server to account for every request
    request_timeout_s: float = 600.0  # longest wait for one response
    prompt: str = PROMPT
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("streams", "stream_tokens", "short_tokens", "short_workers", "mixed_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("short_requests", "mixed_requests", "memory_tolerance_mib", "settle_s", "warmup_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.mixed_workers < 1 or self.cancel_after_chunks < 1 or self.disconnect_after_events < 1:
            raise ValueError("mixed_workers, cancel_after_chunks and disconnect_after_events must be >= 1")


@dataclass(frozen=True)
class Endpoints:
    """Where the server answers; `server_pid` is tritonserver's process (None: found by the gRPC port)."""

    grpc_url: str  # HOST:PORT
    http_url: str  # HOST:PORT of the generate endpoints (`serve`'s published, checked HTTP port)
    metrics_url: str  # http://HOST:PORT/metrics
    server_pid: int | None = None
    shm_prefix: str | None = None  # the stubs' /dev/shm region prefix, where known


@dataclass
class RequestRecord:
    """One request as its client saw it."""

    phase: str  # "load" or "mixed"
    kind: str  # stream, short, complete, cancel, disconnect, bad
    transport: str  # grpc, http
    reaches_model: bool  # False for a request refused before the model (HTTP front, Triton)
    outcome: str = ""  # ok, error, cancelled (by this client), disconnected (by this client)
    tokens: int = 0  # completion tokens the server reported (0 when it reported none)
    chunks: int = 0  # text chunks or events received
    ttft_s: float | None = None  # first text received, from the request's start
    duration_s: float = 0.0  # last response received, from the request's start
    detail: str = ""  # the error message, for an error
    streamed: bool = True  # False: the text came whole, so time to first token is not measured

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None below two tokens)."""
        if self.ttft_s is None or self.tokens < 2 or not self.streamed:
            return None
        return (self.duration_s - self.ttft_s) / (self.tokens - 1)


@dataclass(frozen=True)
class MemorySnapshot:
    label: str
    processes: int  # tritonserver and the processes it started
    rss_mib: float
    shm_mib: float  # /dev/shm space of the regions they map
    shm_regions: int


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass, fail, skipped
    detail: str


@dataclass
class PhaseResult:
    name: str
    wall_s: float
    requests: list[RequestRecord]
    metrics: dict[str, float]  # differences of the server's counters over the phase (and its settling)

    @property
    def client_tokens(self) -> int:
        return sum(record.tokens for record in self.requests)

    @property
    def reached_model(self) -> int:
        return sum(record.reaches_model for record in self.requests)


@dataclass
class LoadResult:
    config: LoadConfig
    meta: dict[str, Any]
    phases: list[PhaseResult]
    memory: list[MemorySnapshot]
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    def failures(self) -> list[Check]:
        return [check for check in self.checks if check.status == "fail"]


# ---------------------------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text as (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def metric_total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for sample, have, value in samples
        if sample == name and all(have.get(key) == want for key, want in labels.items())
    )


def scrape(metrics_url: str) -> dict[str, float]:
    """The figures the checks use: outcomes, tokens, pending requests, Triton's success and failure."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            samples = parse_metrics(response.read().decode())
    except OSError as error:
        raise LoadError(f"cannot read metrics at {metrics_url}: {error}") from None
    figures = {
        f"outcome_{outcome}": metric_total(
            samples, "tokenswift:request_success_total", model=MODEL, outcome=outcome
        )
        for outcome in OUTCOMES
    }
    figures["generation_tokens"] = metric_total(samples, "tokenswift:generation_tokens_total", model=MODEL)
    figures["prompt_tokens"] = metric_total(samples, "tokenswift:prompt_tokens_total", model=MODEL)
    figures["triton_success"] = metric_total(samples, "nv_inference_request_success", model=MODEL)
    figures["triton_failure"] = metric_total(samples, "nv_inference_request_failure", model=MODEL)
    figures["pending"] = metric_total(samples, PENDING, model=MODEL)
    figures["has_pending"] = float(any(name == PENDING for name, _, _ in samples))
    return figures


def _outcomes(figures: dict[str, float]) -> float:
    return sum(figures[f"outcome_{outcome}"] for outcome in OUTCOMES)


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {
        name: after[name] - before.get(name, 0.0) for name in after if name not in ("pending", "has_pending")
    }


# ----------------------------------------------------------------------------------------------- memory


def _psutil():
    try:
        import psutil
    except ImportError:
        raise LoadError("measuring the server's memory needs psutil: pip install psutil") from None
    return psutil


def find_server_pid(grpc_url: str) -> int | None:
    """The tritonserver process listening on `grpc_url`'s port (None when none is visible)."""
    psutil = _psutil()
    port = int(grpc_url.rsplit(":", 1)[1])
    for process in psutil.process_iter(["name"]):
        if process.info["name"] != "tritonserver":
            continue
        try:
            listening = process.net_connections("tcp")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in listening):
            return process.pid
    return None


def measure_memory(label: str, pid: int, shm_prefix: str | None = None) -> MemorySnapshot:
    """RSS of `pid` and its descendants, and the /dev/shm regions they map (or carry `shm_prefix`)."""
    psutil = _psutil()
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        raise LoadError(f"the server process {pid} is gone") from None
    rss = 0
    regions: set[str] = set()
    counted = 0
    for process in tree:
        try:
            rss += process.memory_info().rss
            regions.update(m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/"))
            counted += 1
        except psutil.Error:  # ended in between
            continue
    if shm_prefix:
        regions.update(str(path) for path in Path("/dev/shm").glob(f"{shm_prefix}*"))
    shm = 0
    for region in regions:
        try:
            shm += os.stat(region).st_blocks * 512
        except OSError:
            continue
    return MemorySnapshot(label, counted, rss / 2**20, shm / 2**20, len(regions))


# ---------------------------------------------------------------------------------------------- clients


def _params(config: LoadConfig, seed: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"text_input": config.prompt, "max_tokens": max_tokens, "seed": seed, "ignore_eos": True, **extra}


def _timed(record: RequestRecord, call: Callable[[Callable[[str], None]], Result]) -> RequestRecord:
    """Run `call(on_text)`, filling the record's timings, tokens and outcome."""
    start = time.perf_counter()

    def on_text(piece: str) -> None:
        if record.ttft_s is None:
            record.ttft_s = time.perf_counter() - start

    try:
        result = call(on_text)
    except ClientError as error:
        record.outcome, record.detail = "error", str(error).splitlines()[0][:300]
    except (OSError, queue.Empty) as error:
        record.outcome, record.detail = "failed", f"{type(error).__name__}: {error}"[:300]
    else:
        record.chunks = result.chunks
        record.tokens = int(result.stats.get("completion_tokens", 0))
        final = "completion_tokens" in result.stats
        record.outcome = "ok" if final else "cancelled"
    if not record.streamed:  # the whole text arrived at the end: no first-token time to read
        record.ttft_s = None
    record.duration_s = time.perf_counter() - start
    return record


def _post_raw(http_url: str, path: str, body: bytes, timeout_s: float) -> tuple[int, str]:
    """POST a body as is (a malformed one included): (HTTP status, error message or '')."""
    request = urllib.request.Request(
        f"http://{http_url}{path}", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        raw = error.read().removeprefix(b"data: ")
        try:
            return error.code, str(json.loads(raw).get("error", raw.decode(errors="replace")))
        except (json.JSONDecodeError, AttributeError):
            return error.code, raw.decode(errors="replace")


def _disconnect(http_url: str, params: dict[str, Any], events: int, record: RequestRecord, timeout_s: float):
    """A generate_stream client that reads `events` server-sent events, then closes its socket."""
    body = json.dumps(params).encode()
    host, port = http_url.rsplit(":", 1)
    start = time.perf_counter()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as connection:
            connection.sendall(
                b"POST /v2/models/tokenswift/generate_stream HTTP/1.1\r\nHost: load\r\nConnection: close\r\n"
                + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while received.count(b"data: ") < events:
                piece = connection.recv(65536)
                if not piece:
                    break
                if record.ttft_s is None and b"data: " in received + piece:
                    record.ttft_s = time.perf_counter() - start
                received += piece
        record.chunks = received.count(b"data: ")
        if b'"error"' in received:
            record.outcome, record.detail = "error", received.split(b"data: ", 1)[-1][:300].decode()
        else:
            # a stream shorter than `events` ends before the client can leave: the request completed
            record.outcome = "disconnected" if record.chunks >= events else "ended"
    except OSError as error:
        record.outcome, record.detail = "failed", f"{type(error).__name__}: {error}"[:300]
    record.duration_s = time.perf_counter() - start
    return record


# (transport, body or params, reaches the model): HTTP bodies the front refuses never reach Triton;
# values of the right type but out of range reach the model, which refuses them
def _bad_request(config: LoadConfig, index: int) -> tuple[str, bytes | dict[str, Any], bool]:
    prompt = config.prompt
    cases: list[tuple[str, bytes | dict[str, Any], bool]] = [
        ("http", b"not json", False),
        ("grpc", {"text_input": prompt, "max_tokens": 0}, True),
        ("http", json.dumps({"text_input": prompt, "max_tokens": "ten"}).encode(), False),
        ("http", json.dumps({"text_input": prompt, "max_tokens": 8, "temperature": -1.0}).encode(), True),
        ("http", json.dumps({"text_input": prompt, "max_tokens": 8, "temprature": 0}).encode(), False),
        ("grpc", {"text_input": prompt, "max_tokens": 8, "method": "beam"}, True),
    ]
    return cases[index % len(cases)]


def mixed_plan(config: LoadConfig) -> list[str]:
    """Phase 2's request kinds in sending order: 20% cancels, 15% disconnects, 15% bad, the rest
    completions (half gRPC streams, half HTTP generate), shuffled by the seed."""
    n = config.mixed_requests
    cancels, disconnects, bad = round(0.2 * n), round(0.15 * n), round(0.15 * n)
    complete = n - cancels - disconnects - bad
    kinds = (
        ["complete-grpc"] * (complete - complete // 2)
        + ["complete-http"] * (complete // 2)
        + ["cancel"] * cancels
        + ["disconnect"] * disconnects
        + ["bad"] * bad
    )
    random.Random(config.seed).shuffle(kinds)
    return kinds


def _mixed_request(config: LoadConfig, endpoints: Endpoints, index: int, kind: str, bad_index: int):
    seed = config.seed + 10_000 + index
    tokens = config.mixed_tokens
    timeout = config.request_timeout_s
    if kind == "complete-grpc":
        record = RequestRecord("mixed", "complete", "grpc", True)
        params = _params(config, seed, tokens, stream=True)
        return _timed(record, lambda on: grpc_generate(endpoints.grpc_url, params, on, timeout))
    if kind == "complete-http":
        record = RequestRecord("mixed", "complete", "http", True, streamed=False)
        params = _params(config, seed, tokens)
        return _timed(record, lambda on: generate_endpoint(endpoints.http_url, params, False, on, timeout))
    if kind == "cancel":
        record = RequestRecord("mixed", "cancel", "grpc", True)
        params = _params(config, seed, tokens, stream=True)
        chunks = config.cancel_after_chunks
        return _timed(
            record,
            lambda on: grpc_generate(endpoints.grpc_url, params, on, timeout, cancel_after_chunks=chunks),
        )
    if kind == "disconnect":
        record = RequestRecord("mixed", "disconnect", "http", True)
        params = _params(config, seed, tokens, stream=True)
        return _disconnect(endpoints.http_url, params, config.disconnect_after_events, record, timeout)
    transport, body, reaches = _bad_request(config, bad_index)
    record = RequestRecord("mixed", "bad", transport, reaches)
    if transport == "grpc":
        assert isinstance(body, dict)
        return _timed(record, lambda on: grpc_generate(endpoints.grpc_url, body, on, timeout))
    assert isinstance(body, bytes)
    start = time.perf_counter()
    status, message = _post_raw(endpoints.http_url, "/v2/models/tokenswift/generate", body, timeout)
    record.duration_s = time.perf_counter() - start
    record.outcome = "error" if status >= 400 else "ok"
    record.detail = f"HTTP {status}: {message}"[:300]
    return record


def _expected(record: RequestRecord, config: LoadConfig) -> bool:
    """Whether a request got the answer its kind expects."""
    if record.kind == "bad":
        return record.outcome == "error" and (
            record.transport == "grpc" or record.detail.startswith("HTTP 400")
        )
    if record.kind in ("stream", "short", "complete"):
        wanted = {"stream": config.stream_tokens, "short": config.short_tokens}.get(
            record.kind, config.mixed_tokens
        )
        return record.outcome == "ok" and record.tokens == wanted
    if record.kind == "cancel":  # a request may end before the cancel arrives
        return record.outcome == "cancelled" or (record.outcome == "ok" and record.tokens > 0)
    return record.outcome in ("disconnected", "ended")


# ------------------------------------------------------------------------------------------------ phases


def _wait_idle(endpoints: Endpoints, outcomes_wanted: float, timeout_s: float) -> dict[str, float]:
    """Scrape until every request is accounted for and none is pending (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = scrape(endpoints.metrics_url)
        if (_outcomes(figures) >= outcomes_wanted and figures["pending"] == 0) or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def run_load_phase(config: LoadConfig, endpoints: Endpoints) -> tuple[list[RequestRecord], float]:
    """Phase 1: the long streams and the short requests at once; (records, wall seconds)."""
    records: list[RequestRecord] = []
    timeout = config.request_timeout_s

    def stream(index: int) -> RequestRecord:
        params = _params(config, config.seed + index, config.stream_tokens, stream=True)
        record = RequestRecord("load", "stream", "grpc", True)
        return _timed(record, lambda on: grpc_generate(endpoints.grpc_url, params, on, timeout))

    shorts: queue.Queue[int] = queue.Queue()
    for index in range(config.short_requests):
        shorts.put(index)

    def short_client() -> list[RequestRecord]:
        done = []
        while True:
            try:
                index = shorts.get_nowait()
            except queue.Empty:
                return done
            params = _params(config, config.seed + 1000 + index, config.short_tokens)
            record = RequestRecord("load", "short", "http", True)
            done.append(
                _timed(
                    record,
                    lambda on, params=params: generate_endpoint(
                        endpoints.http_url, params, True, on, timeout
                    ),
                )
            )

    start = time.perf_counter()
    with ThreadPoolExecutor(config.streams + config.short_workers) as pool:
        streams = [pool.submit(stream, index) for index in range(config.streams)]
        clients = [pool.submit(short_client) for _ in range(min(config.short_workers, config.short_requests))]
        records += [future.result() for future in streams]
        for future in clients:
            records += future.result()
    return records, time.perf_counter() - start


def run_mixed_phase(config: LoadConfig, endpoints: Endpoints) -> tuple[list[RequestRecord], float]:
    """Phase 2: completions, cancels, disconnects and bad requests; (records in plan order, wall s)."""
    plan = mixed_plan(config)
    bad_indices = {}
    for index, kind in enumerate(plan):
        if kind == "bad":
            bad_indices[index] = len(bad_indices)
    start = time.perf_counter()
    with ThreadPoolExecutor(config.mixed_workers) as pool:
        futures = [
            pool.submit(_mixed_request, config, endpoints, index, kind, bad_indices.get(index, 0))
            for index, kind in enumerate(plan)
        ]
        records = [future.result() for future in futures]
    return records, time.perf_counter() - start


def run_load(
    config: LoadConfig,
    endpoints: Endpoints,
    meta: dict[str, Any] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> LoadResult:
    """Both phases with memory and metrics around them, and the checks."""
    say = on_progress or (lambda message: None)
    load_average_start = os.getloadavg()  # a shared machine's other work shows here
    pid = endpoints.server_pid or find_server_pid(endpoints.grpc_url)
    memory: list[MemorySnapshot] = []

    def snapshot(label: str) -> None:
        if pid is not None:
            memory.append(measure_memory(label, pid, endpoints.shm_prefix))

    if config.warmup_tokens:
        say(f"warm-up: one request x {config.warmup_tokens} tokens")
        try:
            grpc_generate(
                endpoints.grpc_url,
                _params(config, config.seed, config.warmup_tokens),
                timeout_s=config.request_timeout_s,
            )
        except (ClientError, OSError, queue.Empty) as error:
            raise LoadError(f"the warm-up request failed: {str(error).splitlines()[0]}") from None
    start_figures = scrape(endpoints.metrics_url)
    if start_figures["pending"]:
        raise LoadError(
            f"the server has {start_figures['pending']:g} pending requests: run on an idle server"
        )
    snapshot("before")
    say(
        f"phase 1: {config.streams} gRPC streams x {config.stream_tokens} tokens with "
        f"{config.short_requests} HTTP requests x {config.short_tokens} tokens"
    )
    load_records, load_wall = run_load_phase(config, endpoints)
    load_wanted = _outcomes(start_figures) + sum(r.reaches_model for r in load_records)
    after_load = _wait_idle(endpoints, load_wanted, config.idle_timeout_s)
    time.sleep(config.settle_s)
    snapshot("after_load")
    say(
        f"phase 2: {config.mixed_requests} requests x {config.mixed_tokens} tokens "
        "(completions, cancels, disconnects, bad requests)"
    )
    mixed_records, mixed_wall = run_mixed_phase(config, endpoints)
    mixed_wanted = _outcomes(after_load) + sum(r.reaches_model for r in mixed_records)
    idle_start = time.perf_counter()
    _wait_idle(endpoints, mixed_wanted, config.idle_timeout_s)
    idle_s = time.perf_counter() - idle_start
    time.sleep(config.settle_s)
    snapshot("after_mixed")
    final = scrape(endpoints.metrics_url)
    phases = [
        PhaseResult("load", load_wall, load_records, _delta(after_load, start_figures)),
        PhaseResult("mixed", mixed_wall, mixed_records, _delta(final, after_load)),
    ]
    meta = {
        **(meta or {}),
        "server_pid": pid,
        "idle_after_mixed_s": round(idle_s, 3),
        "load_average_start": [round(value, 2) for value in load_average_start],
        "load_average_end": [round(value, 2) for value in os.getloadavg()],
    }
    result = LoadResult(config, meta, phases, memory)
    result.checks = checks(result, final, pid is not None)
    return result


def checks(result: LoadResult, final: dict[str, float], memory_measured: bool) -> list[Check]:
    """The accounting and leak checks of a finished run (`final`: the last scrape)."""
    config = result.config
    found: list[Check] = []
    records = [record for phase in result.phases for record in phase.requests]
    wrong = [r for r in records if not _expected(r, config)]
    found.append(
        Check(
            "answers",
            "fail" if wrong else "pass",
            f"{len(records) - len(wrong)}/{len(records)} requests got the answer their kind expects"
            + (
                "; first unexpected: "
                + f"{wrong[0].kind} over {wrong[0].transport} -> {wrong[0].outcome} {wrong[0].detail}"
                if wrong
                else ""
            ),
        )
    )
    reached = sum(phase.reached_model for phase in result.phases)
    counted = sum(_outcomes(phase.metrics) for phase in result.phases)
    found.append(
        Check(
            "accounted",
            "pass" if counted == reached else "fail",
            f"tokenswift:request_success_total grew by {counted:g} (ok + error + cancelled) for {reached} "
            "requests that reached the model",
        )
    )
    load = result.phases[0]
    server_tokens = load.metrics["generation_tokens"]
    found.append(
        Check(
            "load_tokens",
            "pass" if server_tokens == load.client_tokens else "fail",
            f"phase 1: the server counted {server_tokens:g} generated tokens, the clients received "
            f"{load.client_tokens}",
        )
    )
    if final["has_pending"]:
        found.append(
            Check(
                "pending",
                "pass" if final["pending"] == 0 else "fail",
                f"{PENDING} is {final['pending']:g} after phase 2",
            )
        )
    else:
        found.append(Check("pending", "skipped", f"the server reports no {PENDING}"))
    if not memory_measured:
        reason = "tritonserver's process was not found (a server on another machine or user?)"
        found += [Check("rss", "skipped", reason), Check("shm", "skipped", reason)]
        return found
    by_label = {snapshot.label: snapshot for snapshot in result.memory}
    loaded, mixed = by_label["after_load"], by_label["after_mixed"]
    tolerance = config.memory_tolerance_mib
    for name, unit in (("rss", "resident memory"), ("shm", "/dev/shm")):
        before, after = getattr(loaded, f"{name}_mib"), getattr(mixed, f"{name}_mib")
        found.append(
            Check(
                name,
                "pass" if after <= before + tolerance else "fail",
                f"{unit} {before:.1f} MiB after phase 1, {after:.1f} MiB after phase 2 "
                f"(tolerance +{tolerance:g} MiB)",
            )
        )
    return found


# ------------------------------------------------------------------------------------------ local server


@contextmanager
def local_server(engine: Path, instances: int = 1, log_path: Path | None = None) -> Iterator[Endpoints]:
    """A tritonserver on free loopback ports for `engine`, with `serve`'s checked HTTP front."""
    from tokenswift_trt.serving.http_front import HttpFront
    from tokenswift_trt.serving.server import MODEL_REPO, TritonServer, local_config

    config = local_config(engine, instances=instances)
    server = TritonServer(config, log_path=log_path)
    try:
        server.start()
        assert server.process is not None
        with HttpFront("127.0.0.1", 0, server.http_url, MODEL_REPO / "tokenswift" / "config.pbtxt") as front:
            yield Endpoints(
                server.grpc_url, front.url, server.metrics_url, server.process.pid, server.shm_prefix
            )
    finally:  # a server that failed to start leaves its staging folder too
        server.stop()
        server.cleanup()


# ---------------------------------------------------------------------------------------------- report


def hardware() -> dict[str, str]:
    """The machine: lscpu's model name and CPU count, the platform, Python and torch."""
    found = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    for line in lscpu.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Architecture"):
            found[key.strip().lower().replace(" ", "_").replace("(s)", "s")] = value.strip()
    try:
        import torch

        found["torch"] = torch.__version__
    except ImportError:
        found["torch"] = "not installed"
    return found


def run_meta(command: str, endpoints: Endpoints) -> dict[str, Any]:
    """Date, machine, the command and the server's version (from its HTTP metadata)."""
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        **hardware(),
    }
    try:
        with urllib.request.urlopen(f"http://{endpoints.http_url}/v2", timeout=10) as response:
            server = json.loads(response.read())
        meta["server"] = f"{server.get('name', 'triton')} {server.get('version', '?')}"
    except (OSError, ValueError, AttributeError):
        meta["server"] = "unknown"
    return meta


def check_reachable(endpoints: Endpoints) -> None:
    """Raise LoadError naming the first endpoint that does not answer."""
    try:
        with urllib.request.urlopen(f"http://{endpoints.http_url}/v2/health/ready", timeout=10) as response:
            response.read()
    except OSError as error:
        raise LoadError(f"no server answers HTTP at {endpoints.http_url}: {error}") from None
    import tritonclient.grpc as grpcclient

    try:
        ready = grpcclient.InferenceServerClient(endpoints.grpc_url).is_model_ready(MODEL)
    except Exception as error:  # tritonclient raises its own exception type for every failure
        raise LoadError(
            f"no server answers gRPC at {endpoints.grpc_url}: {str(error).splitlines()[0]}"
        ) from None
    if not ready:
        raise LoadError(f"the server at {endpoints.grpc_url} has no ready model {MODEL!r}")
    scrape(endpoints.metrics_url)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord]) -> dict[str, Any]:
    """Counts by outcome and the p50/p95 of TTFT, TPOT and duration over `records`."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    tpot = [t for r in records if (t := r.tpot_s) is not None]
    duration = [r.duration_s for r in records]
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record.outcome] = outcomes.get(record.outcome, 0) + 1
    return {
        "requests": len(records),
        "outcomes": outcomes,
        "tokens": sum(r.tokens for r in records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "tpot_p50_ms": None if not tpot else 1e3 * float(np.percentile(tpot, 50)),
        "tpot_p95_ms": None if not tpot else 1e3 * float(np.percentile(tpot, 95)),
        "duration_p50_s": percentile(duration, 50),
        "duration_p95_s": percentile(duration, 95),
        "duration_max_s": max(duration) if duration else None,
    }


def report(result: LoadResult) -> dict[str, Any]:
    """The JSON document of a run."""
    phases = []
    for phase in result.phases:
        kinds = sorted({record.kind for record in phase.requests})
        phases.append(
            {
                "name": phase.name,
                "wall_s": phase.wall_s,
                "requests": len(phase.requests),
                "reached_model": phase.reached_model,
                "client_tokens": phase.client_tokens,
                "tokens_per_s": phase.client_tokens / phase.wall_s if phase.wall_s else None,
                "server": phase.metrics,
                "all": summarize(phase.requests),
                "by_kind": {kind: summarize([r for r in phase.requests if r.kind == kind]) for kind in kinds},
            }
        )
    return {
        "meta": result.meta,
        "config": asdict(result.config),
        "passed": result.passed,
        "checks": [asdict(check) for check in result.checks],
        "memory": [asdict(snapshot) for snapshot in result.memory],
        "phases": phases,
        "requests": [
            asdict(record) | {"tpot_s": record.tpot_s} for phase in result.phases for record in phase.requests
        ],
    }


def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(document: dict[str, Any]) -> str:
    """A short summary of the JSON document."""
    meta = document["meta"]
    lines = [
        "# Serving load test",
        "",
        f"- date: {meta.get('date')}",
        f"- machine: {meta.get('model_name', '?')}, {meta.get('cpus', '?')} CPUs; {meta.get('platform')}",
        f"- python {meta.get('python')}, torch {meta.get('torch')}, server {meta.get('server')}",
        f"- load average (1, 5, 15 min) at start {meta.get('load_average_start')}, "
        f"at end {meta.get('load_average_end')}",
        f"- command: `{meta.get('command')}`",
        f"- checks: {'all passed' if document['passed'] else 'FAILED'}",
        "",
        "| phase | kind | requests | outcomes | tokens | tokens/s | TTFT p50 / p95 s | TPOT p50 / p95 ms "
        "| duration p50 / p95 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for phase in document["phases"]:
        rows = [("all", phase["all"], phase["tokens_per_s"])] + [
            (kind, summary, None) for kind, summary in phase["by_kind"].items()
        ]
        for kind, s, rate in rows:
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
            lines.append(
                f"| {phase['name']} | {kind} | {s['requests']} | {outcomes} | {s['tokens']} "
                f"| {_figure(rate)} "
                f"| {_figure(s['ttft_p50_s'])} / {_figure(s['ttft_p95_s'])} "
                f"| {_figure(s['tpot_p50_ms'])} / {_figure(s['tpot_p95_ms'])} "
                f"| {_figure(s['duration_p50_s'])} / {_figure(s['duration_p95_s'])} |"
            )
    lines += [
        "",
        "| phase | wall s | reached the model | ok | error | cancelled | generated tokens (server) |",
    ]
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for phase in document["phases"]:
        server = phase["server"]
        lines.append(
            f"| {phase['name']} | {phase['wall_s']:.1f} | {phase['reached_model']} "
            f"| {server['outcome_ok']:g} | {server['outcome_error']:g} | {server['outcome_cancelled']:g} "
            f"| {server['generation_tokens']:g} |"
        )
    if document["memory"]:
        lines += [
            "",
            "| memory | processes | RSS MiB | /dev/shm MiB | shm regions |",
            "| --- | --- | --- | --- | --- |",
        ]
        for snapshot in document["memory"]:
            lines.append(
                f"| {snapshot['label']} | {snapshot['processes']} | {snapshot['rss_mib']:.1f} "
                f"| {snapshot['shm_mib']:.1f} | {snapshot['shm_regions']} |"
            )
    lines += ["", "| check | status | detail |", "| --- | --- | --- |"]
    for check in document["checks"]:
        lines.append(f"| {check['name']} | {check['status']} | {check['detail']} |")
    return "\n".join(lines) + "\n"


def write_report(result: LoadResult, out_dir: Path) -> list[Path]:
    """serve_load.json, serve_load.md and requests.csv (one row per request) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = report(result)
    json_path = out_dir / "serve_load.json"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    md_path = out_dir / "serve_load.md"
    md_path.write_text(markdown(document))
    csv_path = write_csv(out_dir / "requests.csv", document["requests"])
    return [json_path, md_path, csv_path]
