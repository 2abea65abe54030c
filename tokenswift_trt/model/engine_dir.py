"""Engine directories: a manifest (`tokenswift.json`) plus the artifacts it lists, each with its sha256.

Layout written by `tokenswift-trt build`:
    tokenswift.json          manifest (format version, shapes, dtype, the preset's settings, ...)
    model/                   Hugging Face format: config.json, model.safetensors, heads.safetensors,
    tokenizer.json
    model/tp-N/rank-R.safetensors   instead of model.safetensors with `build --tp N`: rank R's slices
                             (model/tensor_parallel.py), loaded only with --tp N
    onnx/                    verify.onnx, draft.onnx            (backends onnx and tensorrt)
    tensorrt/                verify.plan, draft.plan            (backend tensorrt)
    build.log
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
from tokenswift_trt.model.config import config_from_dict, load_config

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
    # `build --tp N`: {"size": N, "shards": [rank 0's file, ...]} (relative to the engine dir); {}: unsplit
    tp: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def tp_size(self) -> int:
        """The tensor-parallel size the weights were split for at build time (1: not split)."""
        return int(self.tp.get("size", 1))


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


def check_tp_size(built: int, engine_dir: Path, size: int) -> None:
    """Raise EngineDirError (one line naming the fix) unless an engine built with `build --tp M`
    (`built`: M) is loaded with --tp M (an unsplit engine, `built` 1, loads with any --tp)."""
    if built == 1 or built == size:
        return
    if size == 1:
        raise EngineDirError(
            f"{engine_dir} was built with --tp {built} (one weights file per rank): pass --tp {built}, or "
            "rebuild it without --tp"
        )
    raise EngineDirError(
        f"{engine_dir} was built with --tp {built}, not --tp {size}: pass --tp {built}, or rebuild it with "
        f"`build --tp {size}`"
    )


def engine_tp_size(engine_dir: Path) -> int:
    """The --tp an engine dir was built for (1: unsplit, or not an engine dir); reads only the manifest."""
    try:
        return int(json.loads((Path(engine_dir) / MANIFEST).read_text()).get("tp", {}).get("size", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        return 1  # no or unreadable manifest: loading says what is wrong


def write_manifest(engine_dir: Path, manifest: Manifest) -> Path:
    path = engine_dir / MANIFEST
    path.write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return path


def read_manifest(engine_dir: str | Path, verify: str = "auto", rank: int | None = None) -> Manifest:
    """Read and check an engine dir. verify: "auto" (hash files up to 2 GiB, size-check the rest), "full",
    "none". `rank`: of an engine built with `build --tp N`, the rank loading it: the other ranks' weight
    files are size-checked only (a rank reads no other rank's file)."""
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
    shards = list(manifest.tp.get("shards", []))
    others = {name for index, name in enumerate(shards) if rank is not None and index != rank}
    for relative, entry in manifest.artifacts.items():
        artifact = engine_dir / relative
        if not artifact.is_file():
            raise EngineDirError(f"engine artifact {artifact} is missing: rebuild the engine")
        if artifact.stat().st_size != entry["bytes"]:
            raise EngineDirError(
                f"engine artifact {artifact} has the wrong size (corrupt or replaced): rebuild the engine"
            )
        if relative in others:
            continue
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
