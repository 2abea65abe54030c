"""A bounded load test of a `tokenswift` server: throughput and latency under load, every request
accounted for.

`streams` long gRPC streams (`stream_tokens` each, EOS ignored, distinct seeds) and, at the same time,
`short_requests` short HTTP `generate_stream` requests (`short_tokens` each) sent by `short_workers`
clients one after another. Reported: generated tokens per second over the run, and per request,
measured at the client, the time to first token, the time per output token after the first and the
request's duration.

Before and after the load (once the server is idle, plus `settle_s`), the server's memory is read: the
resident memory of tritonserver and every process it started (the Python-backend stubs) and the
/dev/shm regions they map. The metrics port is scraped at the same moments. The checks: every request
got the answer its kind expects; every request is counted once in `tokenswift:request_success_total`
(ok + error + cancelled); the generated tokens counted by the server equal the tokens the clients
received; no request is pending afterwards.

The counters are read as differences, so a target server must have no other traffic during the run.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenswift_trt.environment import machine_meta
from tokenswift_trt.serving.client import ClientError, Result, generate_endpoint, grpc_generate

from .report import write_csv

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
MODEL = "tokenswift"
OUTCOMES = ("ok", "error", "cancelled")
PENDING = "nv_inference_pending_request_count"
COUNTERS = {  # figure: the server's counter (summed over the model's samples)
    "generation_tokens": "tokenswift:generation_tokens_total",
    "prompt_tokens": "tokenswift:prompt_tokens_total",
    "triton_success": "nv_inference_request_success",
    "triton_failure": "nv_inference_request_failure",
    "pending": PENDING,
}


class LoadError(RuntimeError):
    """The load test cannot run (no server, no psutil, a server that stops answering)."""


@dataclass(frozen=True)
class LoadConfig:
    streams: int = 8  # concurrent long gRPC streams
    stream_tokens: int = 512
    short_requests: int = 16  # short HTTP generate_stream requests alongside the streams
    short_tokens: int = 16
    short_workers: int = 4  # clients sending the short requests, one after another each
    settle_s: float = 2.0  # wait once the server is idle, before memory is read
    warmup_tokens: int = 16  # one request before the load (first-request setup), outside the figures
    idle_timeout_s: float = 120.0  # longest wait for the server to account for every request
    request_timeout_s: float = 600.0  # longest wait for one response
    prompt: str = PROMPT
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("streams", "stream_tokens", "short_tokens", "short_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("short_requests", "settle_s", "warmup_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")


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

    kind: str  # stream, short
    transport: str  # grpc, http
    outcome: str = ""  # ok, error, cancelled, failed (no answer)
    tokens: int = 0  # completion tokens the server reported (0 when it reported none)
    chunks: int = 0  # text chunks or events received
    ttft_s: float | None = None  # first text received, from the request's start
    duration_s: float = 0.0  # last response received, from the request's start
    detail: str = ""  # the error message, for an error

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None below two tokens)."""
        if self.ttft_s is None or self.tokens < 2:
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
class LoadResult:
    config: LoadConfig
    meta: dict[str, Any]
    wall_s: float  # from the first request sent to the last answer
    requests: list[RequestRecord]
    metrics: dict[str, float]  # differences of the server's counters over the run (and its settling)
    memory: list[MemorySnapshot]
    checks: list[Check] = field(default_factory=list)

    @property
    def client_tokens(self) -> int:
        return sum(record.tokens for record in self.requests)

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
    for key, name in COUNTERS.items():
        figures[key] = metric_total(samples, name, model=MODEL)
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
    record.duration_s = time.perf_counter() - start
    return record


def _expected(record: RequestRecord, config: LoadConfig) -> bool:
    """Whether a request got all the tokens it asked for."""
    wanted = config.stream_tokens if record.kind == "stream" else config.short_tokens
    return record.outcome == "ok" and record.tokens == wanted


# -------------------------------------------------------------------------------------------------- load


def _wait_idle(endpoints: Endpoints, outcomes_wanted: float, timeout_s: float) -> dict[str, float]:
    """Scrape until every request is accounted for and none is pending (or `timeout_s` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        figures = scrape(endpoints.metrics_url)
        if (_outcomes(figures) >= outcomes_wanted and figures["pending"] == 0) or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def run_requests(config: LoadConfig, endpoints: Endpoints) -> tuple[list[RequestRecord], float]:
    """The long streams and the short requests at once; (records, wall seconds)."""
    timeout = config.request_timeout_s

    def stream(index: int) -> RequestRecord:
        params = _params(config, config.seed + index, config.stream_tokens, stream=True)
        record = RequestRecord("stream", "grpc")
        return _timed(record, lambda on: grpc_generate(endpoints.grpc_url, params, on, timeout))

    def short(index: int) -> RequestRecord:
        params = _params(config, config.seed + 1000 + index, config.short_tokens)
        record = RequestRecord("short", "http")
        return _timed(record, lambda on: generate_endpoint(endpoints.http_url, params, True, on, timeout))

    start = time.perf_counter()  # `short_workers` clients send the short requests, one after another each
    with ThreadPoolExecutor(config.streams) as streams, ThreadPoolExecutor(config.short_workers) as shorts:
        futures = [streams.submit(stream, index) for index in range(config.streams)]
        futures += [shorts.submit(short, index) for index in range(config.short_requests)]
        records = [future.result() for future in futures]
    return records, time.perf_counter() - start


def run_load(
    config: LoadConfig,
    endpoints: Endpoints,
    meta: dict[str, Any] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> LoadResult:
    """The load with memory and metrics read around it, and the checks."""
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
        f"{config.streams} gRPC streams x {config.stream_tokens} tokens with "
        f"{config.short_requests} HTTP requests x {config.short_tokens} tokens"
    )
    records, wall = run_requests(config, endpoints)
    idle_start = time.perf_counter()
    final = _wait_idle(endpoints, _outcomes(start_figures) + len(records), config.idle_timeout_s)
    idle_s = time.perf_counter() - idle_start
    time.sleep(config.settle_s)
    snapshot("after")
    meta = {
        **(meta or {}),
        "server_pid": pid,
        "idle_after_s": round(idle_s, 3),
        "load_average_start": [round(value, 2) for value in load_average_start],
        "load_average_end": [round(value, 2) for value in os.getloadavg()],
    }
    result = LoadResult(config, meta, wall, records, _delta(final, start_figures), memory)
    result.checks = checks(result, final)
    return result


def checks(result: LoadResult, final: dict[str, float]) -> list[Check]:
    """The accounting checks of a finished run (`final`: the last scrape)."""
    records = result.requests
    wrong = [r for r in records if not _expected(r, result.config)]
    detail = f"{len(records) - len(wrong)}/{len(records)} requests got every token they asked for"
    if wrong:
        first = wrong[0]
        detail += f"; first unexpected: {first.kind} over {first.transport} -> {first.outcome} "
        detail += f"{first.tokens} tokens {first.detail}"
    found = [Check("answers", "fail" if wrong else "pass", detail)]
    counted = _outcomes(result.metrics)
    found.append(
        Check(
            "accounted",
            "pass" if counted == len(records) else "fail",
            f"tokenswift:request_success_total grew by {counted:g} (ok + error + cancelled) for "
            f"{len(records)} requests",
        )
    )
    server_tokens = result.metrics["generation_tokens"]
    found.append(
        Check(
            "tokens",
            "pass" if server_tokens == result.client_tokens else "fail",
            f"the server counted {server_tokens:g} generated tokens, the clients received "
            f"{result.client_tokens}",
        )
    )
    if final["has_pending"]:
        found.append(
            Check(
                "pending", "pass" if final["pending"] == 0 else "fail", f"{PENDING} is {final['pending']:g}"
            )
        )
    else:
        found.append(Check("pending", "skipped", f"the server reports no {PENDING}"))
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


def run_meta(command: str, endpoints: Endpoints) -> dict[str, Any]:
    """Date, machine, the command and the server's version (from its HTTP metadata)."""
    meta: dict[str, Any] = {
        **machine_meta(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
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
    kinds = sorted({record.kind for record in result.requests})
    return {
        "meta": result.meta,
        "config": asdict(result.config),
        "passed": result.passed,
        "checks": [asdict(check) for check in result.checks],
        "memory": [asdict(snapshot) for snapshot in result.memory],
        "wall_s": result.wall_s,
        "client_tokens": result.client_tokens,
        "tokens_per_s": result.client_tokens / result.wall_s if result.wall_s else None,
        "server": result.metrics,
        "all": summarize(result.requests),
        "by_kind": {kind: summarize([r for r in result.requests if r.kind == kind]) for kind in kinds},
        "requests": [asdict(record) | {"tpot_s": record.tpot_s} for record in result.requests],
    }


def _figure(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def markdown(document: dict[str, Any]) -> str:
    """A short summary of the JSON document."""
    meta, server = document["meta"], document["server"]
    lines = [
        "# Serving load test",
        "",
        f"- date: {meta.get('date')}",
        f"- machine: {meta.get('cpu', '?')}, {meta.get('cpus', '?')} CPUs, GPU {meta.get('gpu')}",
        f"- python {meta.get('python')}, torch {meta.get('torch')}, server {meta.get('server')}",
        f"- load average (1, 5, 15 min) at start {meta.get('load_average_start')}, "
        f"at end {meta.get('load_average_end')}",
        f"- command: `{meta.get('command')}`",
        f"- checks: {'all passed' if document['passed'] else 'FAILED'}",
        f"- {document['wall_s']:.1f} s; counted by the server: {server['outcome_ok']:g} ok, "
        f"{server['outcome_error']:g} error, {server['outcome_cancelled']:g} cancelled, "
        f"{server['generation_tokens']:g} generated tokens",
        "",
        "| kind | requests | outcomes | tokens | tokens/s | TTFT p50 / p95 s | TPOT p50 / p95 ms "
        "| duration p50 / p95 s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [("all", document["all"], document["tokens_per_s"])]
    rows += [(kind, summary, None) for kind, summary in document["by_kind"].items()]
    for kind, s, rate in rows:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
        lines.append(
            f"| {kind} | {s['requests']} | {outcomes} | {s['tokens']} | {_figure(rate)} "
            f"| {_figure(s['ttft_p50_s'])} / {_figure(s['ttft_p95_s'])} "
            f"| {_figure(s['tpot_p50_ms'])} / {_figure(s['tpot_p95_ms'])} "
            f"| {_figure(s['duration_p50_s'])} / {_figure(s['duration_p95_s'])} |"
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
