"""`bench-serve`: a bounded load test of the server (throughput, latency, memory, every request
accounted for); `bench-batching`: many users at once, batched and not."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from .common import CliError, fail, kernel_option, report_out_option


@click.command("bench-serve")
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path),
    default=Path("models/swift-tiny"),
    show_default=True,
    help="engine (or Hugging Face model) directory of the server started on free loopback ports",
)
@click.option(
    "--grpc-url", default=None, help="HOST:PORT of a running server's gRPC endpoint (no server started)"
)
@click.option(
    "--http-url", default=None, help="HOST:PORT of that server's HTTP endpoint (serve's --http-port)"
)
@click.option("--metrics-url", default=None, help="that server's metrics, e.g. http://HOST:8002/metrics")
@click.option("--instances", type=click.IntRange(1, 64), default=1, show_default=True, help="model instances")
@click.option("--streams", type=click.IntRange(1), default=8, show_default=True, help="long gRPC streams")
@click.option("--stream-tokens", type=click.IntRange(1), default=512, show_default=True)
@click.option(
    "--short-requests",
    type=click.IntRange(0),
    default=16,
    show_default=True,
    help="short HTTP generate_stream requests alongside the streams",
)
@click.option("--short-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    default=4,
    show_default=True,
    help="clients sending the short requests, one request after another each",
)
@click.option(
    "--settle",
    type=click.FloatRange(0),
    default=2.0,
    show_default=True,
    help="seconds idle before memory is read",
)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=1, show_default=True)
@report_out_option("runs/serve-load")
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="keep the started tritonserver's log here",
)
@click.pass_context
def bench_serve(
    context: click.Context,
    engine_dir: Path,
    grpc_url: str | None,
    http_url: str | None,
    metrics_url: str | None,
    instances: int,
    streams: int,
    stream_tokens: int,
    short_requests: int,
    short_tokens: int,
    concurrency: int,
    settle: float,
    seed: int,
    out: Path,
    log_file: Path | None,
) -> None:
    """Serving under load: tokens/s, time to first token, memory; every request accounted for.

    --streams long gRPC streams with --short-requests short HTTP requests at the same time (tokens/s,
    time to first token, time per output token, durations). The server's memory (RSS of tritonserver
    and its stubs, their /dev/shm) and metrics are read before and after. Writes serve_load.json,
    serve_load.md and requests.csv to --out; exits 1 with one line when a check fails (a request cut
    short, not counted by the server, or left pending). A running server (--grpc-url, --http-url,
    --metrics-url) must have no other traffic during the run.
    """
    from tokenswift_trt.bench.serve_load import (
        Endpoints,
        LoadConfig,
        LoadError,
        check_reachable,
        local_server,
        run_load,
        run_meta,
        write_report,
    )
    from tokenswift_trt.serving.server import ServerError

    urls = {"--grpc-url": grpc_url, "--http-url": http_url, "--metrics-url": metrics_url}
    given = [name for name, value in urls.items() if value]
    if given and len(given) != len(urls):
        missing = ", ".join(name for name in urls if name not in given)
        raise CliError(
            f"a running server needs all of --grpc-url, --http-url and --metrics-url (missing {missing})"
        )
    if metrics_url and not metrics_url.startswith(("http://", "https://")):
        raise CliError(f"--metrics-url {metrics_url} must be a URL such as http://127.0.0.1:8002/metrics")
    config = LoadConfig(
        streams=streams,
        stream_tokens=stream_tokens,
        short_requests=short_requests,
        short_tokens=short_tokens,
        short_workers=concurrency,
        settle_s=settle,
        seed=seed,
    )
    command = _command(context, bool(given))

    def progress(message: str) -> None:
        click.echo(message, err=True)

    def measure(endpoints: Endpoints):
        check_reachable(endpoints)
        return run_load(config, endpoints, run_meta(command, endpoints), progress)

    try:
        if given:
            result = measure(Endpoints(str(grpc_url), str(http_url), str(metrics_url)))
        else:
            progress(f"starting tritonserver for {engine_dir}")
            with local_server(engine_dir, instances, log_file) as endpoints:
                result = measure(endpoints)
    except (LoadError, ServerError, OSError) as error:
        raise fail(error) from None
    written = write_report(result, out)
    click.echo(
        f"{len(result.requests)} requests, {result.client_tokens} tokens in {result.wall_s:.1f} s "
        f"({result.client_tokens / result.wall_s:.1f} tokens/s)"
    )
    for snapshot in result.memory:
        click.echo(
            f"memory {snapshot.label}: RSS {snapshot.rss_mib:.1f} MiB, /dev/shm {snapshot.shm_mib:.1f} MiB"
        )
    for check in result.checks:
        click.echo(f"{check.status}: {check.name}: {check.detail}")
    click.echo(f"wrote {', '.join(str(path) for path in written)}")
    failures = result.failures()
    if failures:
        click.echo(
            f"tokenswift-trt: error: check failed: {'; '.join(f'{c.name}: {c.detail}' for c in failures)}",
            err=True,
        )
        sys.exit(1)


def _command(context: click.Context, running: bool) -> str:
    """The command line that repeats this run, every option spelt out."""
    words = ["tokenswift-trt", "bench-serve"]
    for parameter in context.command.params:
        value = context.params.get(parameter.name or "")
        if value is None or not isinstance(parameter, click.Option):
            continue
        if running and parameter.name in ("engine_dir", "instances", "log_file"):
            continue
        words += [parameter.opts[0], str(value)]
    return shlex.join(words)


@click.command("bench-batching")
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path),
    default=Path("models/smollm2-135m"),
    show_default=True,
    help="engine (or Hugging Face model) directory the servers load",
)
@click.option(
    "--tokens", type=click.IntRange(1), default=1024, show_default=True, help="new tokens per request"
)
@click.option(
    "--concurrency",
    default="1,2,4,8",
    show_default=True,
    help="concurrent requests at each level, comma-separated (at most 8)",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/batching"), show_default=True)
@kernel_option
def bench_batching(engine_dir, tokens, concurrency, out, kernels) -> None:
    """Many users at once: aggregate tokens/s, time to first token and per-request speed of one instance
    without batching, two instances, batched AR and batched TokenSwift, side by side in one run; every
    request's text checked against its single run. Writes batching.json and batching.md to --out."""
    import json

    from tokenswift_trt.bench.batching import markdown, run_batching_bench
    from tokenswift_trt.serving.server import ServerError

    try:
        levels = [int(level) for level in concurrency.split(",")]
    except ValueError:
        raise CliError(f"--concurrency takes numbers separated by commas, got {concurrency!r}") from None
    if not engine_dir.is_dir():
        raise CliError(f"engine directory {engine_dir} does not exist (run `make models` for smollm2-135m)")
    try:
        report = run_batching_bench(engine_dir, tokens, levels, kernels)
    except (ValueError, ServerError, OSError) as error:
        raise fail(error) from None
    report["meta"]["command"] = shlex.join(["tokenswift-trt", "bench-batching", *sys.argv[2:]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "batching.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "batching.md").write_text(markdown(report))
    click.echo(markdown(report))
