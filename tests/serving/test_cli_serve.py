"""`tokenswift-trt serve` as a user runs it: ready line, `client` over gRPC and HTTP, clean SIGTERM stop."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokenswift_trt.serving.server import _bundled

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
CLI = [sys.executable, "-m", "tokenswift_trt.cli"]


@pytest.mark.slow
def test_serve_client_and_sigterm(tmp_path):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    from test_triton import _free_ports

    http, grpc, metrics = _free_ports(3)
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--engine",
            str(MODEL),
            "--http-port",
            str(http),
            "--grpc-port",
            str(grpc),
            "--metrics-port",
            str(metrics),
            "--kernel",  # reaches the Triton model's `kernels` parameter (a speed-only one: same tokens)
            "huge_pages=off",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("ready:"), line + server.stderr.read()
        streamed = subprocess.run(
            [
                *CLI,
                "client",
                "--url",
                f"127.0.0.1:{grpc}",
                "--prompt",
                "It is a truth",
                "--max-tokens",
                "16",
                "--seed",
                "3",
                "--ignore-eos",
                "--stream",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert streamed.returncode == 0, streamed.stderr
        assert "acceptance_rate=" in streamed.stderr
        over_http = subprocess.run(
            [
                *CLI,
                "client",
                "--url",
                f"127.0.0.1:{http}",
                "--protocol",
                "http",
                "--prompt",
                "It is a truth",
                "--max-tokens",
                "16",
                "--seed",
                "3",
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert over_http.returncode == 0 and over_http.stdout.strip() == streamed.stdout.strip()
        drafting = ["--tree", "1,1,1", "--draft-source", "verify", "--max-tokens", "48", "--seed", "3"]
        calls = {
            adapt: subprocess.run(
                [*CLI, "client", "--url", f"127.0.0.1:{grpc}", "--prompt", "It is a truth", "--ignore-eos"]
                + drafting
                + (["--adapt-drafts"] if adapt else []),
                capture_output=True,
                text=True,
                timeout=300,
            )
            for adapt in (False, True)
        }
        stats = {}
        for adapt, call in calls.items():
            assert call.returncode == 0, call.stderr
            stats[adapt] = dict(pair.split("=") for pair in call.stderr.split())
        assert float(stats[True]["draft_updates"]) > 0 and float(stats[False]["draft_updates"]) == 0
        assert calls[True].stdout == calls[False].stdout  # the request adapted; its text is unchanged
        bad = subprocess.run(
            [*CLI, "client", "--url", f"127.0.0.1:{grpc}", "--prompt", "x", "--max-tokens", "40000"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (
            bad.returncode == 2
            and bad.stderr.startswith("tokenswift-trt: error: server error")
            and "maximum length" in bad.stderr
        )
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    unreachable = subprocess.run(
        [
            *CLI,
            "client",
            "--url",
            f"127.0.0.1:{grpc}",
            "--protocol",
            "http",
            "--prompt",
            "x",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr


def test_deploy_script_dry_run_prints_the_container_command():
    script = Path(__file__).resolve().parents[2] / "deploy" / "deploy.sh"
    result = subprocess.run(
        ["bash", str(script)],
        env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "PRESET": "qwen2.5-7b"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "build --model qwen2.5-7b --backend torch" in result.stdout
    assert "docker run -d --name tokenswift-qwen2.5-7b --gpus all" in result.stdout
    assert "tokenswift-trt serve --engine /engine --host 0.0.0.0 --device cuda" in result.stdout
    assert "--instances 1 --max-batch 8" in result.stdout


def _serve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "engine, extra, said",
    [
        ("missing", (), "does not exist"),
        ("empty", (), "neither an engine (tokenswift.json) nor a Hugging Face model directory"),
        ("model", ("--device", "cuda"), "no CUDA GPU is visible to PyTorch: serve with --device cpu"),
    ],
)
def test_serve_refuses_what_cannot_load_before_starting_tritonserver(tmp_path, engine, extra, said):
    import torch

    if extra and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: --device cuda loads")
    (tmp_path / "empty").mkdir()
    source = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "model": MODEL}[engine]
    result = _serve("--engine", str(source), *extra, timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "starting tritonserver" not in result.stderr


@pytest.mark.slow
def test_a_model_that_fails_to_load_in_tritonserver_is_named_with_its_reason(tmp_path):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    from test_triton import _free_ports

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')  # no sizes: the stub's load fails
    http, grpc, metrics, openai = _free_ports(4)
    result = _serve(
        "--engine",
        str(broken),
        "--no-drafts",
        *("--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)),
        *("--openai-port", str(openai)),
    )
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "the model failed to load:" in error, result.stderr
    assert "NVML" not in error


@pytest.mark.parametrize("option", ["--http-port", "--grpc-port", "--metrics-port", "--openai-port"])
def test_serve_refuses_a_port_in_use_before_starting_tritonserver(option):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--engine", str(MODEL), option, str(port), timeout=120)
    assert result.returncode == 2, result.stderr
    assert (
        f"cannot listen on 127.0.0.1:{port} (Address already in use): choose another {option}"
        in result.stderr
    )
    assert result.stderr.count("\n") == 1 and "starting tritonserver" not in result.stderr
