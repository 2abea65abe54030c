"""TensorRT engines: built and run only where `tensorrt` and a CUDA GPU exist (skipped here otherwise)."""

from __future__ import annotations

import pytest
import torch

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.backends.tensorrt_backend import TensorRTBackendError, import_tensorrt
from tokenswift_trt.builder.build import BuildRequest, build_engine
from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.sampling import SamplingConfig

from helpers import PAPER_TREE


def _tensorrt_available() -> str | None:
    try:
        import_tensorrt()
    except TensorRTBackendError:
        return "tensorrt is not installed (its wheels come from NVIDIA's index; see docs/build.md)"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    return None


def test_missing_tensorrt_is_a_clear_error():
    if _tensorrt_available() is None:
        pytest.skip("tensorrt is installed here")
    with pytest.raises(TensorRTBackendError, match="needs the `tensorrt` package"):
        import_tensorrt()


@pytest.mark.skipif(_tensorrt_available() is not None, reason=str(_tensorrt_available()))
def test_tensorrt_engine_decodes_like_torch(llama_dir, tmp_path):
    from tokenswift_trt.builder.random_model import byte_level_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        (checkpoint / name).write_bytes((llama_dir[0] / name).read_bytes())
    byte_level_tokenizer().save(str(checkpoint / "tokenizer.json"))
    out = build_engine(
        BuildRequest(
            model=str(checkpoint), out=tmp_path / "trt", backend="tensorrt", dtype="float32", no_drafts=True
        )
    )
    engine, manifest = load_engine_dir(out, device="cuda")
    reference, _ = load_engine_dir(
        build_engine(BuildRequest(model=str(checkpoint), out=tmp_path / "torch", no_drafts=True)),
        device="cuda",
    )
    prompt = list(range(3, 40))
    config = GenerationConfig(
        tree=PAPER_TREE, max_new_tokens=64, sampling=SamplingConfig(temperature=0), ignore_eos=True
    )
    assert generate(engine, prompt, config)[0] == generate(reference, prompt, config)[0]
