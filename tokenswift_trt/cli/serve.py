"""`serve` (a real tritonserver) and `client` (Triton's gRPC/HTTP clients)."""

from __future__ import annotations

from pathlib import Path

import click

from .common import CliError, PositiveGiB, check_engine_tp, fail, kernel_option, read_prompt
from .tp_launch import tp_options


def check_source(engine_dir: Path, device: str, no_drafts: bool = False) -> None:
    """What would stop the model loading inside tritonserver (or have it serve at AR speed without
    `no_drafts`), said in one line before it starts."""
    from tokenswift_trt.builder.build import no_drafts_line
    from tokenswift_trt.model.engine import has_draft_layers
    from tokenswift_trt.model.engine_dir import MANIFEST

    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda but no CUDA GPU is visible to PyTorch: serve with --device cpu")
    if not engine_dir.is_dir():
        raise CliError(
            f"engine directory {engine_dir} does not exist: give an engine (`tokenswift-trt build`) or a "
            "Hugging Face model directory"
        )
    if not (engine_dir / MANIFEST).is_file() and not (engine_dir / "config.json").is_file():
        raise CliError(
            f"{engine_dir} is neither an engine ({MANIFEST}) nor a Hugging Face model directory "
            "(config.json): build an engine with `tokenswift-trt build`"
        )
    model_dir = engine_dir / "model" if (engine_dir / MANIFEST).is_file() else engine_dir
    if not no_drafts and not has_draft_layers(model_dir):
        raise CliError(no_drafts_line(engine_dir, "serve"))


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Every port `serve` publishes is free on `host`, said in one line before tritonserver starts
    (`ports`: option -> port)."""
    import socket

    seen: dict[int, str] = {}
    for option, port in ports.items():
        if port in seen:
            raise CliError(f"{option} and {seen[port]} are both {port}: give each endpoint its own port")
        seen[port] = option
        probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: past TIME_WAIT
        try:
            probe.bind((host, port))
        except OSError as error:
            raise CliError(
                f"cannot listen on {host}:{port} ({error.strerror or error}): choose another {option}"
            ) from None
        finally:
            probe.close()


def check_tp(engine_dir: Path, tp: int, instances: int, device: str) -> None:
    """`serve --tp N`: one instance, N GPUs under --device cuda (rank r on cuda:r), and a size the
    model's heads split into (one line otherwise, before anything loads)."""
    from tokenswift_trt.model.config import load_config
    from tokenswift_trt.model.tensor_parallel import TensorParallelError, check_size

    if instances != 1:
        raise CliError(f"--tp {tp} serves one instance spanning {tp} ranks: drop --instances")
    if device not in ("cpu", "cuda", "cuda:0"):
        raise CliError(f"serve --tp {tp} puts rank r on cuda:r: give --device cuda (or --device cpu)")
    if device != "cpu":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < tp:
            raise CliError(
                f"serve --tp {tp} --device cuda needs {tp} GPUs (one per rank), this node has {gpus}: "
                + (f"give --tp {gpus} or fewer" if gpus > 1 else "serve on the CPU with --device cpu")
            )
    model_dir = engine_dir / "model" if (engine_dir / "model" / "config.json").is_file() else engine_dir
    try:
        check_size(load_config(model_dir), tp)
    except (TensorParallelError, OSError, ValueError) as error:
        raise CliError(str(error).strip().splitlines()[0]) from None


@click.command()
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="engine directory (or Hugging Face model dir)",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option(
    "--instances",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="model instances (each holds the weights, each runs its own batch on its share of the CPUs)",
)
@click.option(
    "--max-batch",
    type=click.IntRange(0, 256),
    default=8,
    show_default=True,
    help="requests an instance decodes together (continuous batching); 0 = one at a time",
)
@click.option(
    "--max-queue",
    type=click.IntRange(0, 100000),
    default=256,
    show_default=True,
    help="requests an instance keeps waiting for room in its batch; one more is refused at once "
    "(HTTP 503 with Retry-After, gRPC UNAVAILABLE)",
)
@click.option("--device", default="cpu", show_default=True)
@click.option(
    "--journal-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="keep a journal per request_id here, so that resume=true continues after a crash",
)
@click.option(
    "--memory-budget",
    type=PositiveGiB(),
    default=None,
    help="GiB the caches of an instance's requests may use together (with --max-batch 0: one "
    "request's; default: free memory)",
)
@click.option(
    "--openai-port",
    type=click.IntRange(0, 65535),
    default=9000,
    show_default=True,
    help="port of the OpenAI-compatible API (/v1/completions, /v1/chat/completions); 0 = off",
)
@click.option(
    "--served-model-name",
    default=None,
    help="model id of the OpenAI-compatible API (default: the engine directory's name)",
)
@click.option(
    "--no-drafts",
    is_flag=True,
    help="serve a model that has no draft layers anyway (TokenSwift then runs at AR speed)",
)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="keep tritonserver's log here (default: a temporary file removed when serve exits)",
)
@kernel_option
@tp_options
def serve(
    engine_dir,
    host,
    http_port,
    grpc_port,
    metrics_port,
    instances,
    max_batch,
    max_queue,
    device,
    journal_dir,
    memory_budget,
    openai_port,
    served_model_name,
    no_drafts,
    log_file,
    kernels,
    tp,
    tp_timeout,
) -> None:
    """Serve an engine from a real tritonserver (HTTP, gRPC, metrics) until Ctrl-C or SIGTERM."""
    import signal
    import time

    from tokenswift_trt.serving.http_front import HttpFront
    from tokenswift_trt.serving.openai_api import OpenAIFrontend
    from tokenswift_trt.serving.openai_requests import FrontendError
    from tokenswift_trt.serving.server import MODEL_REPO, ServerConfig, ServerError, TritonServer, free_port

    if tp > 1:  # its GPU count first: rank r on cuda:r
        check_tp(engine_dir, tp, instances, device)
    check_source(engine_dir, device, no_drafts)
    check_engine_tp(engine_dir, tp)
    ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port}
    if openai_port:
        ports["--openai-port"] = openai_port
    check_ports(host, ports)
    # tritonserver's HTTP endpoint stays on loopback; the published HTTP port is the front that checks
    # generate requests before relaying them (a malformed body gets HTTP 400, not Triton's 500)
    config = ServerConfig(
        engine=engine_dir,
        host=host,
        http_port=free_port(avoid=(http_port, grpc_port, metrics_port, openai_port)),
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        instances=instances,
        max_batch=max_batch,
        max_queue=max_queue,
        device=device,
        journal_dir=journal_dir,
        memory_budget_gib=memory_budget,
        http_host="127.0.0.1",
        kernels=kernels,
        tp=tp,
        tp_timeout=tp_timeout,
    )
    server = TritonServer(config, log_path=log_file)
    click.echo(f"starting tritonserver (log: {server.log_path})", err=True)
    fronts: list = []

    def shut_down() -> None:
        for front in fronts:  # new requests are refused; streams the server cuts end with an error event
            front.drain()
        server.stop()  # ends the stubs too and frees their shared memory, whatever state they are in
        for front in fronts:
            front.stop(grace_s=2.0)  # time for the cut streams' last events

    try:
        server.start()
        http = HttpFront(host, http_port, server.http_url, MODEL_REPO / "tokenswift" / "config.pbtxt").start()
        fronts.append(http)
        if openai_port:
            fronts.append(
                OpenAIFrontend(server.http_url, engine_dir, host, openai_port, served_model_name).start()
            )
    except (ServerError, FrontendError, OSError) as error:
        shut_down()
        server.cleanup()
        raise fail(error) from None
    openai_url = f"  openai {fronts[1].url}" if openai_port else ""
    click.echo(f"ready: http://{http.url}  grpc {server.grpc_url}  metrics {server.metrics_url}{openai_url}")
    click.echo(
        f"try: curl -X POST http://{http.url}/v2/models/tokenswift/generate "
        '-d \'{"text_input": "Once upon a time", "max_tokens": 64}\''
    )
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    crashed: int | None = None
    try:
        while not stopping and (crashed := server.exit_code()) is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if crashed is None:
            click.echo("stopping tritonserver", err=True)
        shut_down()
        tail = server.log_tail() if crashed is not None else ""
        server.cleanup()
    if crashed is not None:
        raise CliError(
            f"tritonserver exited unexpectedly (code {crashed}): {tail}; requests in flight were stopped "
            "(their journals keep what was committed: resume them with resume=true); restart `serve`"
        )


@click.command()
@click.option(
    "--url", default="127.0.0.1:8001", show_default=True, help="HOST:PORT of the gRPC or HTTP endpoint"
)
@click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True)
@click.option("--prompt", default=None)
@click.option("--prompt-file", type=click.Path(path_type=Path), default=None)
@click.option("--max-tokens", type=int, required=True)
@click.option("--stream", is_flag=True, help="print text as it arrives")
@click.option("--temperature", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--min-p", type=float, default=None)
@click.option("--eta", type=float, default=None)
@click.option("--penalty", type=float, default=None, help="sent as repetition_penalty (θ)")
@click.option("--penalty-window", type=int, default=None)
@click.option("--ngram-topk", type=int, default=None)
@click.option("--tree", default=None, help="candidates per depth, or auto")
@click.option("--draft-source", type=click.Choice(["auto", "partial", "verify"]), default=None)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None)
@click.option("--method", type=click.Choice(["tokenswift", "ar"]), default=None)
@click.option("--ignore-eos", is_flag=True)
@click.option(
    "--adapt-drafts",
    is_flag=True,
    help="the request adapts its own copy of the draft layers as it generates (output unchanged)",
)
def client(
    url,
    protocol,
    prompt,
    prompt_file,
    max_tokens,
    stream,
    temperature,
    top_k,
    top_p,
    min_p,
    eta,
    penalty,
    penalty_window,
    ngram_topk,
    tree,
    draft_source,
    seed,
    method,
    ignore_eos,
    adapt_drafts,
) -> None:
    """Call a running server with Triton's clients; print text (as it arrives with --stream) and stats."""
    from tokenswift_trt.serving.client import ClientError, generate_endpoint, grpc_generate

    text = read_prompt(prompt, prompt_file)
    params = {"text_input": text, "max_tokens": max_tokens, "stream": stream}
    optional = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "eta": eta,
        "repetition_penalty": penalty,
        "penalty_window": penalty_window,
        "ngram_topk": ngram_topk,
        "tree": tree,
        "draft_source": draft_source,
        "seed": seed,
        "method": method,
        "ignore_eos": ignore_eos or None,
        "adapt_drafts": adapt_drafts or None,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    on_text = (lambda piece: click.echo(piece, nl=False)) if stream else None
    try:
        if protocol == "grpc":
            result = grpc_generate(url, params, on_text)
        else:
            result = generate_endpoint(url, params, stream, on_text)
    except ClientError as error:
        raise CliError(f"server error: {error}") from None
    except OSError as error:
        raise CliError(f"cannot reach {url} over {protocol}: {error}") from None
    click.echo("" if stream else result.text)
    click.echo(" ".join(f"{k}={v:g}" for k, v in result.stats.items()), err=True)
