"""Load an engine directory on the backend its manifest names: the torch forward, or the exported
graphs run by ONNX Runtime or TensorRT around the same torch modules (model/engine_dir.py reads and
checks the manifest)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.backends.onnx_backend import OnnxDecoder
from tokenswift_trt.backends.tensorrt_backend import TensorRTDecoder
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.engine import Engine, load_engine
from tokenswift_trt.model.engine_dir import EngineDirError, Manifest, check_tp_size, read_manifest
from tokenswift_trt.model.tensor_parallel import TensorParallel, TensorParallelError


def load_engine_dir(
    engine_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    verify: str = "auto",
    kernels: Mapping[str, Any] | None = None,
    tp: TensorParallel | None = None,
) -> tuple[Engine, Manifest]:
    """Check the engine dir, then load it on its backend (torch forward, or onnxruntime graphs).
    `kernels`: kernel settings (name -> value) replacing those the manifest records. `tp`: this rank's
    slices of a torch engine (tensor_parallel.py)."""
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir, verify, rank=tp.rank if tp is not None else None)
    if tp is not None and manifest.backend != "torch":
        raise EngineDirError(
            f"--tp runs the torch backend; {engine_dir} was built for {manifest.backend}: build it with "
            "--backend torch"
        )
    check_tp_size(manifest.tp_size, engine_dir, tp.size if tp is not None else 1)
    shards = manifest.tp.get("shards", [])
    settings = KernelConfig.from_dict(manifest.kernels).updated(kernels or {})
    try:
        engine = load_engine(
            engine_dir / "model",
            dtype=dtype or getattr(torch, manifest.dtype),
            device=device,
            kernels=settings,
            tp=tp,
            rank_file=engine_dir / shards[tp.rank] if tp is not None and shards else None,
        )
    except TensorParallelError as error:
        raise EngineDirError(str(error)) from None
    if manifest.backend == "onnx":
        engine.model = OnnxDecoder(engine.model.torch_model, engine_dir / "onnx")
    elif manifest.backend == "tensorrt":
        engine.model = TensorRTDecoder(engine.model.torch_model, engine_dir / "tensorrt")
    return engine, manifest
