"""Engine directories: a manifest (`tokenswift.json`) plus the artifacts it lists, each with its sha256.

Layout written by `tokenswift-trt build`:
    tokenswift.json          manifest (format version, shapes, dtype, the preset's settings, ...)
    model/                   Hugging Face format: config.json, model.safetensors, heads.safetensors,
    tokenizer.json
    onnx/                    verify.onnx, draft.onnx            (backends onnx and tensorrt)
    tensorrt/                verify.plan, draft.plan            (backend tensorrt)
    build.log
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
from tokenswift_trt.model.config import config_from_dict, load_config
from tokenswift_trt.model.engine import Engine, load_engine
from tokenswift_trt.model.tensor_parallel import TensorParallel

MANIFEST = "tokenswift.json"
FORMAT_VERSION = 2  # 2: `defaults` (partial settings) replaces `tree` and `sampling`
BACKENDS = ("torch", "onnx", "tensorrt")
HASH_LIMIT_BYTES = 2 << 30  # larger files are checked by size on load (full check: verify="full")


class EngineDirError(ValueError):
    """An engine directory is missing, corrupt or does not match its manifest."""


@dataclass
class Manifest:
    name: str
    architecture: str
    config: dict[str, Any]  # the model's config.json
    dtype: str
    backend: str
    max_sequence_length: int
    defaults: dict[str, Any]  # the preset's settings: partial overrides of the runtime's (decode/request.py)
    random_weights: bool
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> {"sha256", "bytes"}
    tool_versions: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)  # a GGUF import: {"gguf": file name, "sha256"}
    # the kernel settings it was built with (kernels/config.py), the defaults of its loads
    kernels: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_artifacts(engine_dir: Path, manifest: Manifest) -> None:
    """Fill `manifest.artifacts` with every file under the engine dir except the manifest and log."""
    manifest.artifacts = {}
    for path in sorted(p for p in engine_dir.rglob("*") if p.is_file()):
        relative = path.relative_to(engine_dir).as_posix()
        if relative in (MANIFEST, "build.log"):
            continue
        manifest.artifacts[relative] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}


def write_manifest(engine_dir: Path, manifest: Manifest) -> Path:
    path = engine_dir / MANIFEST
    path.write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return path


def read_manifest(engine_dir: str | Path, verify: str = "auto") -> Manifest:
    """Read and check an engine dir. verify: "auto" (hash files up to 2 GiB, size-check the rest), "full",
    "none"."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise EngineDirError(
            f"engine directory {engine_dir} does not exist: build one with `tokenswift-trt build`"
        )
    if not path.is_file():
        raise EngineDirError(
            f"{engine_dir} has no {MANIFEST}: not an engine directory (build one with `tokenswift-trt build`)"
        )
    try:
        raw = json.loads(path.read_text())
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineDirError(
                f"{path} has format version {version}, this tool reads {FORMAT_VERSION}: rebuild the engine"
            )
        manifest = Manifest(**raw)
    except (json.JSONDecodeError, TypeError) as error:
        raise EngineDirError(f"{path} is corrupt ({error}): rebuild the engine") from None
    if manifest.backend not in BACKENDS:
        raise EngineDirError(f"{path} names unknown backend {manifest.backend!r}")
    try:
        KernelConfig.from_dict(manifest.kernels)
    except KernelConfigError as error:
        raise EngineDirError(f"{path}: {error}: rebuild the engine") from None
    for relative, entry in manifest.artifacts.items():
        artifact = engine_dir / relative
        if not artifact.is_file():
            raise EngineDirError(f"engine artifact {artifact} is missing: rebuild the engine")
        if artifact.stat().st_size != entry["bytes"]:
            raise EngineDirError(
                f"engine artifact {artifact} has the wrong size (corrupt or replaced): rebuild the engine"
            )
        if verify == "full" or (verify == "auto" and entry["bytes"] <= HASH_LIMIT_BYTES):
            if sha256_of(artifact) != entry["sha256"]:
                raise EngineDirError(
                    f"engine artifact {artifact} fails its sha256 check (corrupt or replaced): rebuild "
                    "the engine"
                )
    model_config = load_config(engine_dir / "model")
    if model_config != config_from_dict(manifest.config):
        raise EngineDirError(
            f"{engine_dir / 'model' / 'config.json'} does not match the manifest's model: rebuild the engine"
        )
    return manifest


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
    manifest = read_manifest(engine_dir, verify)
    if tp is not None and manifest.backend != "torch":
        raise EngineDirError(
            f"--tp runs the torch backend; {engine_dir} was built for {manifest.backend}: build it with "
            "--backend torch"
        )
    settings = KernelConfig.from_dict(manifest.kernels).updated(kernels or {})
    engine = load_engine(
        engine_dir / "model",
        dtype=dtype or getattr(torch, manifest.dtype),
        device=device,
        kernels=settings,
        tp=tp,
    )
    if manifest.backend == "onnx":
        from tokenswift_trt.backends.onnx_backend import OnnxDecoder

        engine.model = OnnxDecoder(engine.model.torch_model, engine_dir / "onnx")
    elif manifest.backend == "tensorrt":
        from tokenswift_trt.backends.tensorrt_backend import TensorRTDecoder

        engine.model = TensorRTDecoder(engine.model.torch_model, engine_dir / "tensorrt")
    return engine, manifest
