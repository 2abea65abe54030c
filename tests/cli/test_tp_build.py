"""`build --tp 2`: an engine directory of one weights file per rank, each holding that rank's slices;
`generate --tp 2` on it (real gloo ranks) emits the single-process tokens of the unsplit engine, each
rank reads only its own file, and any other --tp is refused in one line before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.cli import main
from tokenswift_trt.model.engine_dir import EngineDirError, read_manifest
from tokenswift_trt.model.tensor_parallel import TensorParallel, read_shard

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time, a little fox"
GREEDY = ["--temperature", "0"]
SEEDED = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]


def _build(out: Path, *more: str):
    args = ["build", "--model", str(ROOT / "models/swift-tiny"), "--out", str(out), "--dtype", "float32"]
    return CliRunner().invoke(main, [*args, *more])


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> tuple[Path, Path]:
    """(the unsplit engine, the same model built with --tp 2)"""
    root = tmp_path_factory.mktemp("engines")
    for name, more in (("whole", []), ("split", ["--tp", "2"])):
        built = _build(root / name, *more)
        assert built.exit_code == 0, built.output
    return root / "whole", root / "split"


def _generate(engine: Path) -> list[str]:
    return ["generate", "--engine", str(engine), "--prompt", PROMPT, "--max-new-tokens", "40", "--ignore-eos"]


def test_the_engine_holds_one_file_per_rank_with_that_ranks_slices_only(engines):
    whole, split = engines
    manifest = read_manifest(split)
    shards = ["model/tp-2/rank-0.safetensors", "model/tp-2/rank-1.safetensors"]
    assert manifest.tp == {"size": 2, "shards": shards} and manifest.tp_size == 2
    assert not (split / "model" / "model.safetensors").exists()  # no whole-model file
    assert set(shards) <= set(manifest.artifacts)
    from safetensors.torch import load_file

    for rank, shard in enumerate(shards):
        expected = read_shard([whole / "model" / "model.safetensors"], None, TensorParallel(rank, 2))
        written = load_file(str(split / shard))
        assert written.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(written[key], tensor), key
    q_proj = load_file(str(split / shards[0]))["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.shape[0] * 2 == json.loads((split / "model/config.json").read_text())["hidden_size"]


def test_a_rank_reads_only_its_own_file(engines, tmp_path):
    _, split = engines
    copy = tmp_path / "split"
    subprocess.run(["cp", "-r", str(split), str(copy)], check=True)
    other = copy / "model/tp-2/rank-1.safetensors"
    data = bytearray(other.read_bytes())
    data[-8:] = b"\xff" * 8  # rank 1's file corrupted, its size kept
    other.write_bytes(bytes(data))
    engine, _ = load_engine_dir(copy, tp=TensorParallel(0, 2))  # rank 0 neither hashes nor reads it
    assert engine.config.num_kv_heads == 1 and engine.config.num_heads == 4
    with pytest.raises(EngineDirError, match="rank-1.safetensors fails its sha256 check"):
        load_engine_dir(copy, tp=TensorParallel(1, 2))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_two_ranks_on_the_split_engine_emit_the_unsplit_single_process_tokens(engines, sampling):
    whole, split = engines
    command = [sys.executable, "-m", "tokenswift_trt", *_generate(split), "--json", *sampling, "--tp", "2"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1  # rank 0's report alone
    single = CliRunner().invoke(main, [*_generate(whole), "--json", *sampling])
    assert single.exit_code == 0, single.output
    expected = json.loads(single.stdout.strip().splitlines()[-1])["token_ids"]
    assert json.loads(lines[0])["token_ids"] == expected


@pytest.mark.parametrize(
    ("more", "expected"),
    [
        ([], "was built with --tp 2 (one weights file per rank): pass --tp 2, or rebuild it without --tp"),
        (["--tp", "4"], "was built with --tp 2, not --tp 4: pass --tp 2, or rebuild it with `build --tp 4`"),
    ],
    ids=["no-tp", "another-tp"],
)
def test_another_tp_on_a_split_engine_is_refused_in_one_line(engines, more, expected):
    _, split = engines
    result = CliRunner().invoke(main, [*_generate(split), *more])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(expected), result.output
    with pytest.raises(EngineDirError, match="was built with --tp 2"):
        load_engine_dir(split)  # the library refuses the same way


@pytest.mark.parametrize(
    ("more", "expected"),
    [
        (["--tp", "3"], "--tp 3 does not split this model"),
        (["--tp", "2", "--backend", "onnx"], "--tp 2 splits a torch engine"),
    ],
    ids=["size", "backend"],
)
def test_build_refuses_a_split_it_cannot_make_in_one_line(tmp_path, more, expected):
    result = _build(tmp_path / "engine", *more)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.output
    assert not (tmp_path / "engine").exists()
