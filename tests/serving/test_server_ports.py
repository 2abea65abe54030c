"""Ports for tritonserver: chosen distinct, and a refused argument reported with tritonserver's reason."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tokenswift_trt.serving.server import (
    ServerConfig,
    ServerError,
    TritonServer,
    _bundled,
    free_port,
    free_ports,
)

MODEL = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"


def test_free_ports_are_distinct_and_skip_the_ports_to_avoid():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        ports = free_ports(8)
        assert len(set(ports)) == 8 and taken not in ports
    for _ in range(20):  # a port just released is often handed out again: `avoid` must skip it
        released = free_port()
        assert free_port(avoid=(released,)) != released


def test_a_port_tritonserver_refuses_is_reported_with_its_reason(tmp_path):
    if _bundled() is None:
        pytest.skip("nvidia-pytriton (tritonserver binary) is not installed")
    (port,) = free_ports(1)
    config = ServerConfig(engine=MODEL, http_port=port, grpc_port=port, metrics_port=free_port(avoid=(port,)))
    with pytest.raises(ServerError, match="cannot listen to HTTP requests and GRPC requests at the same"):
        TritonServer(config, log_path=tmp_path / "tritonserver.log").start(timeout_s=60)
