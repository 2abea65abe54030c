"""A real tritonserver decoding concurrent requests together (continuous batching): nobody waits for
another request to finish, and every request writes its single run's text, whoever else is in the
batch and whenever it joined."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import pytest

import tokenswift_trt as ts

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[all]")
from tokenswift_trt.serving.client import grpc_generate  # noqa: E402
from tokenswift_trt.serving.server import TritonServer, _bundled, local_config  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
PROMPTS = [
    "It is a truth universally acknowledged, that a single man",
    "Once upon a time there was a little fox who",
    "The river ran past the mill and down to the sea,",
    "In the morning the king called his three sons",
]
SETTINGS = [
    {"seed": 11, "min_p": 0.1},
    {"temperature": 0.0, "method": "ar"},
    {"seed": 13, "min_p": 0.1, "tree": "3,3"},
    {"seed": 14, "temperature": 0.0},
]


@pytest.mark.slow
def test_concurrent_streams_are_decoded_together_with_their_own_tokens(tmp_path):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    model = ts.load(model_dir=MODEL)
    tokens = [480, 400, 520, 440]  # long enough that the last joins before the first ends
    expected = [
        ts.generate(model, prompt, count, ignore_eos=True, **settings).text
        for prompt, count, settings in zip(PROMPTS, tokens, SETTINGS, strict=True)
    ]
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    texts: dict[int, str] = {}
    failures: list[BaseException] = []

    with TritonServer(local_config(MODEL, max_batch=4), log_path=tmp_path / "server.log") as server:

        def run(index: int) -> None:
            params = {
                "text_input": PROMPTS[index],
                "max_tokens": tokens[index],
                "ignore_eos": True,
                "stream": True,
                **SETTINGS[index],
            }
            try:
                texts[index] = grpc_generate(
                    server.grpc_url,
                    params,
                    on_text=lambda piece: first.setdefault(index, time.perf_counter()),
                    timeout_s=300,
                ).text
                ended[index] = time.perf_counter()
            except BaseException as error:  # reported below
                failures.append(error)

        running: list[float] = []
        polling = threading.Event()

        def poll() -> None:  # the batch gauge while the streams run
            while not polling.is_set():
                with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
                    for line in response.read().decode().splitlines():
                        if line.startswith("tokenswift:num_requests_running{"):
                            running.append(float(line.rsplit(" ", 1)[1]))
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        threads = [threading.Thread(target=run, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
            time.sleep(0.2)  # they join one after another, while the others are generating
        for thread in threads:
            thread.join(timeout=600)
        polling.set()
        poller.join()
        time.sleep(0.5)
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            after = response.read().decode()
    assert not failures
    assert [texts[index] for index in range(4)] == expected
    # continuous batching: every stream started before any of them finished
    assert max(first.values()) < min(ended.values())
    assert max(running) >= 3  # the gauge saw the batch
    assert 'tokenswift:num_requests_running{model="tokenswift"} 0' in after
