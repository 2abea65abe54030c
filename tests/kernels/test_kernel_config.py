"""Kernel choices are settings: `KernelConfig` parsing and validation, engines honouring it without the
environment, engine manifests recording it and journals refusing a changed output-deciding one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.builder.build import BuildRequest, build_engine
from tokenswift_trt.builder.random_model import write_random_model
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.config import (
    CASCADE_MIN_WORK,
    KernelConfig,
    KernelConfigError,
    help_text,
    parse_kernel_settings,
)
from tokenswift_trt.model import linear
from tokenswift_trt.model.engine_dir import MANIFEST, EngineDirError, read_manifest
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig

from conftest import quiet_load

SWIFT_TINY = Path(__file__).resolve().parents[2] / "models" / "swift-tiny"
needs_swift_tiny = pytest.mark.skipif(
    not (SWIFT_TINY / "model.safetensors").is_file(), reason="models/swift-tiny is not in this checkout"
)


@pytest.fixture(scope="module")
def cpu_kernels():
    status = kernels.load_cpu_kernels()
    if not status.loaded:
        pytest.skip(status.reason)
    return status.module


def test_defaults_and_which_settings_decide_the_tokens():
    config = KernelConfig()
    assert config.to_dict() == {
        "cpu_kernel": "auto",
        "screened_head": True,
        "huge_pages": True,
        "fused_elementwise": True,
        "batch_invariant": "off",
        "batched_forward": "auto",
        "cuda_attention": "auto",
        "cascade_min_work": CASCADE_MIN_WORK,
        "cascade_tail": "kernel",
        "cascade_prefix": "auto",
        "tree_row_tiles": 0,
        "threads": "auto",
    }
    # screening, huge pages and the thread count give the same bits; every other choice may round
    # differently
    assert set(config.output_deciding()) == set(config.to_dict()) - {"screened_head", "huge_pages", "threads"}
    for item in dataclasses.fields(KernelConfig):
        assert item.metadata["doc"] and item.name in help_text()
    assert "batch_invariant [off; output-deciding]" in help_text() and "huge_pages [on]" in help_text()


def test_command_line_values_are_typed_and_bad_ones_refused_in_one_line():
    parsed = parse_kernel_settings(
        ["cpu_kernel=off", "huge-pages=0", "cascade_min_work=5000", "cascade_prefix=triton:128,64,8,3"]
    )
    assert parsed == {
        "cpu_kernel": "off",
        "huge_pages": False,
        "cascade_min_work": 5000,
        "cascade_prefix": "triton:128,64,8,3",
    }
    assert KernelConfig().updated(parsed).huge_pages is False
    assert parse_kernel_settings(["screened_head=on", "fused_elementwise=false"]) == {
        "screened_head": True,
        "fused_elementwise": False,
    }
    for bad, match in (
        (["tile=2"], r"unknown kernel setting\(s\) tile; known: cpu_kernel, "),
        (["cpu_kernel"], "a kernel setting is NAME=VALUE, got 'cpu_kernel'"),
        (["cpu_kernel=fast"], "cpu_kernel is one of auto, on, off, got 'fast'"),
        (["huge_pages=maybe"], "huge_pages is on or off, got 'maybe'"),
        (["cascade_min_work=lots"], "cascade_min_work takes an integer, got 'lots'"),
        (["cascade_min_work=0"], "cascade_min_work is a positive integer"),
        (["cascade_prefix=triton:100,64,8,3"], "kernel setting cascade_prefix: 'triton:100,64,8,3': BLOCK_M"),
        (["tree_row_tiles=4"], "tree_row_tiles is one of 0, 1, 2, got 4"),
    ):
        with pytest.raises(KernelConfigError, match=match) as caught:
            parse_kernel_settings(bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(KernelConfigError, match="huge_pages takes on or off, got 1"):
        KernelConfig(huge_pages=1)  # a typed value of the wrong type (a hand-edited manifest)
    assert KernelConfig.from_dict(KernelConfig(batch_invariant="on").to_dict()) == KernelConfig(
        batch_invariant="on"
    )
    assert KernelConfig.from_dict(None) == KernelConfig() == KernelConfig.from_dict({})


def test_a_cache_without_huge_pages_never_builds_the_cpu_kernels(monkeypatch):
    def refuse(settings):
        raise AssertionError("the CPU kernels were asked for")

    monkeypatch.setattr(linear, "tiled_kernels", refuse)
    cache = KVCache(2, 2, 16, 1 << 16, settings=KernelConfig(huge_pages=False))  # 8 MB: huge pages apply
    assert cache.keys.shape == (2, 2, 1 << 16, 16) and not cache.keys.any()
    with pytest.raises(AssertionError, match="asked for"):
        KVCache(2, 2, 16, 1 << 16)


@needs_swift_tiny
def test_the_cpu_kernel_choice_is_honoured_without_the_environment_and_gives_equal_tokens(cpu_kernels):
    on = quiet_load(SWIFT_TINY, kernels=KernelConfig(cpu_kernel="on"))
    off = quiet_load(SWIFT_TINY, kernels=KernelConfig(cpu_kernel="off"))
    assert on.model.attention_kernel == "cpu_tree_attention" and on.model.cpu_decoder is not None
    assert off.model.attention_kernel == "sdpa" and off.model.cpu_decoder is None
    kinds = {
        name: {m._packed.kind for m in engine.model.modules() if getattr(m, "_packed", None) is not None}
        for name, engine in (("on", on), ("off", off))
    }
    assert kinds == {"on": {"tiled"}, "off": {"onednn"}}
    config = GenerationConfig(
        max_new_tokens=48, sampling=SamplingConfig(temperature=0), seed=0, tree="2,2", ignore_eos=True
    )
    prompt = list(range(10, 60))
    assert generate(on, prompt, config)[0] == generate(off, prompt, config)[0]


def test_build_records_the_kernel_settings_and_loads_take_them_with_overrides(tmp_path):
    checkpoint = write_random_model(tmp_path / "checkpoint", seed=2)
    settings = KernelConfig(cpu_kernel="off", batch_invariant="on", cascade_min_work=1234)
    out = build_engine(BuildRequest(model=str(checkpoint), out=tmp_path / "engine", kernels=settings))
    assert json.loads((out / MANIFEST).read_text())["kernels"] == settings.to_dict()
    assert read_manifest(out).kernels == settings.to_dict()
    engine, _ = load_engine_dir(out)
    assert engine.kernels == settings and engine.model.attention_kernel == "sdpa"
    engine, _ = load_engine_dir(out, kernels={"cpu_kernel": "auto", "huge_pages": False})
    assert engine.kernels == dataclasses.replace(settings, cpu_kernel="auto", huge_pages=False)
    # a manifest written before kernel settings were recorded loads with the defaults
    raw = json.loads((out / MANIFEST).read_text())
    del raw["kernels"]
    (out / MANIFEST).write_text(json.dumps(raw))
    assert load_engine_dir(out)[0].kernels == KernelConfig()
    raw["kernels"] = {"cpu_kernel": "sometimes"}
    (out / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(EngineDirError, match="cpu_kernel is one of auto, on, off.*rebuild the engine"):
        read_manifest(out)
