"""`serve --kernel NAME=VALUE`: the settings reach the Triton model's `kernels` parameter and the
session's engine loads with them (over the engine manifest's)."""

from __future__ import annotations

import re

from tokenswift_trt.builder.build import BuildRequest, build_engine
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.kernels.config import KernelConfig, parse_kernel_settings
from tokenswift_trt.serving.handler import Session
from tokenswift_trt.serving.server import ServerConfig, prepare_repository


def test_served_engines_take_the_kernel_settings_over_their_manifests(tmp_path):
    checkpoint = write_random_model(tmp_path / "checkpoint", seed=4)
    built = KernelConfig(batch_invariant="on", screened_head=False)
    engine_dir = build_engine(BuildRequest(model=str(checkpoint), out=tmp_path / "engine", kernels=built))
    given = parse_kernel_settings(["cpu_kernel=off", "huge_pages=off", "cascade_prefix=triton:128,64,8,3"])
    repo = prepare_repository(ServerConfig(engine=engine_dir, kernels=given), tmp_path / "work")
    pbtxt = (repo / "tokenswift" / "config.pbtxt").read_text()
    parameter = re.search(r'key: "kernels" value: \{ string_value: "([^"]*)" \}', pbtxt)
    assert parameter is not None
    assert parameter[1] == "cpu_kernel=off;huge_pages=off;cascade_prefix=triton:128,64,8,3"
    session = Session(engine_dir, kernels=parameter[1])
    assert session.engine.kernels == KernelConfig(
        cpu_kernel="off",
        huge_pages=False,
        cascade_prefix="triton:128,64,8,3",
        batch_invariant="on",
        screened_head=False,
    )
    assert session.engine.model.attention_kernel == "sdpa"
    assert Session(engine_dir).engine.kernels == built  # none given: the manifest's
    empty = prepare_repository(ServerConfig(engine=engine_dir), tmp_path / "plain")
    assert 'key: "kernels" value: { string_value: "" }' in (empty / "tokenswift" / "config.pbtxt").read_text()
    assert Session(checkpoint, kernels="cpu_kernel=off").engine.kernels == KernelConfig(cpu_kernel="off")
