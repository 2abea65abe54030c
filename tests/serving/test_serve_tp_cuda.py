"""`serve --tp 2 --device cuda`: one Triton model instance whose ranks run on cuda:0 and cuda:1 over
NCCL. Where the node has fewer GPUs than ranks the command refuses in one line before anything loads;
on a node with 2 GPUs the server answers as `generate --tp 2 --device cuda` does (the same split, the
same NCCL sums), and a worker killed mid-request fails that request only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tokenswift_trt.cli import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "swift-tiny"
PROMPT = "It is a truth universally acknowledged, that a single man"
GPUS = torch.cuda.device_count()
TWO_GPUS = pytest.mark.skipif(
    GPUS < 2, reason=f"serve --tp 2 --device cuda needs 2 GPUs, this node has {GPUS}"
)


@pytest.mark.skipif(GPUS >= 2, reason="this node has the GPUs: the refusal does not apply")
def test_serve_tp_on_fewer_gpus_than_ranks_is_refused_in_one_line(tmp_path):
    missing = tmp_path / "no-such-engine"  # nothing is read: the GPU count is checked first
    result = CliRunner().invoke(main, ["serve", "--engine", str(missing), "--tp", "2", "--device", "cuda"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [
        "tokenswift-trt: error: serve --tp 2 --device cuda needs 2 GPUs (one per rank), this node has "
        f"{GPUS}: serve on the CPU with --device cpu"
    ]


def _workers(server) -> list[int]:
    """Pids of the server's worker ranks."""
    group = os.getpgid(server.process.pid)
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"_worker_main" in (entry / "cmdline").read_bytes():
                if os.getpgid(int(entry.name)) == group:
                    found.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return found


@TWO_GPUS
@pytest.mark.slow
def test_serve_tp_2_on_two_gpus_answers_as_generate_tp_2_and_survives_a_killed_worker(tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
    from tokenswift_trt.serving.client import ClientError, grpc_generate
    from tokenswift_trt.serving.server import TritonServer, _bundled, local_config

    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    command = [
        sys.executable,
        "-m",
        "tokenswift_trt",
        "generate",
        "--model-dir",
        str(MODEL),
        "--prompt",
        PROMPT,
    ]
    command += ["--max-new-tokens", "40", "--ignore-eos", "--temperature", "0", "--json"]
    command += ["--tp", "2", "--device", "cuda", "--dtype", "float32"]
    generated = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(generated.stdout.strip().splitlines()[-1])["text"]

    config = local_config(MODEL, tp=2, tp_timeout=20.0, device="cuda", kernels={})
    params = {"text_input": PROMPT, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    with TritonServer(config, log_path=tmp_path / "server.log") as server:
        assert grpc_generate(server.grpc_url, {**params, "stream": True}).text == expected
        (worker,) = _workers(server)
        outcome: dict = {}

        def long_request() -> None:
            try:
                outcome["result"] = grpc_generate(
                    server.grpc_url, {**params, "max_tokens": 4000}, timeout_s=300
                )
            except ClientError as error:
                outcome["error"] = str(error)

        thread = threading.Thread(target=long_request, daemon=True)
        thread.start()
        threading.Event().wait(3.0)
        os.kill(worker, signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive() and "tensor-parallel rank stopped" in outcome.get("error", ""), outcome
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=5) as response:
            assert response.status == 200
        assert grpc_generate(server.grpc_url, params).text == expected  # the group formed again
