"""One request, one config: the Triton handler and the CLI build equal GenerationConfigs, field by
field, from an engine's defaults and the request's settings (decode/request.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenswift_trt.builder.build import BuildRequest, build_engine
from tokenswift_trt.cli.common import early_defaults, generation_config, load_source
from tokenswift_trt.decode.request import SETTINGS, settings_of
from tokenswift_trt.serving.handler import REQUEST_SETTINGS, Session

# a value for every setting a Triton request can carry, none of them a default
EVERY_SETTING = {
    "temperature": 0.7,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "eta": 0.01,
    "repetition_penalty": 1.1,
    "penalty_window": 64,
    "ngram_topk": 4,
    "seed": 123,
    "method": "ar",
    "ignore_eos": True,
    "tree": "1,2,2",
    "draft_source": "partial",
    "adapt_drafts": True,
}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """The swift-tiny preset built into an engine dir: its manifest carries the preset's settings."""
    return build_engine(BuildRequest(model="swift-tiny", out=tmp_path_factory.mktemp("engines") / "tiny"))


def _triton_inputs(request: dict) -> dict[str, np.ndarray]:
    inputs = {
        "text_input": np.array([b"It is a truth"], dtype=np.object_),
        "max_tokens": np.array([96], dtype=np.int32),
    }
    for name, value in request.items():
        inputs[name] = np.array([value.encode() if isinstance(value, str) else value])
    return inputs


def _cli_options(request: dict) -> dict:
    """The same request as the CLI's options (`--penalty` is Triton's repetition_penalty)."""
    renamed = {REQUEST_SETTINGS[name][0]: value for name, value in request.items()}
    method = renamed.pop("method", "tokenswift")
    return method, renamed


def _assert_equal_field_by_field(triton, cli) -> None:
    triton_settings, cli_settings = settings_of(triton), settings_of(cli)
    assert set(triton_settings) == set(cli_settings) == set(SETTINGS)
    for name in SETTINGS:
        assert triton_settings[name] == cli_settings[name], name
    assert dataclasses.asdict(triton) == dataclasses.asdict(cli)


@pytest.mark.parametrize(
    "request_settings",
    [{}, EVERY_SETTING, {"min_p": 0.2, "tree": "auto"}],
    ids=["engine-defaults", "every-setting", "some-settings"],
)
def test_triton_and_cli_build_equal_configs(engine_dir, request_settings):
    session = Session(engine_dir)
    triton = session.parse(_triton_inputs(request_settings)).config
    source = load_source(None, None, engine_dir, None, None, "cpu", quiet=True)
    method, options = _cli_options(request_settings)
    cli = generation_config(96, method, options, source.defaults)
    _assert_equal_field_by_field(triton, cli)


def test_the_engines_defaults_reach_both_and_the_request_overrides_them(engine_dir):
    session = Session(engine_dir)
    plain = session.parse(_triton_inputs({})).config
    preset = {"min_p": 0.1, "penalty": 1.2, "penalty_window": 256, "kv_budget": 1024}  # swift-tiny's
    assert {name: settings_of(plain)[name] for name in preset} == preset
    assert plain.tree.auto and plain.max_length == session.max_length
    given = session.parse(_triton_inputs(EVERY_SETTING)).config
    assert given.sampling.min_p == 0.05 and given.sampling.eta == 0.01 and given.draft_source == "partial"
    assert given.kv_budget == 1024  # not a request setting: the engine's stays


def test_the_defaults_read_before_loading_are_those_the_loaded_engine_reports(engine_dir):
    """A command builds its config once, before loading, from the defaults its engine's manifest
    records: they equal the loaded source's."""
    early = early_defaults(None, None, engine_dir, None)
    source = load_source(None, None, engine_dir, None, None, "cpu", quiet=True)
    assert early == source.defaults
    assert early["min_p"] == 0.1 and early["max_length"] == source.engine.config.max_position_embeddings
