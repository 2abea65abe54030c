"""`tokenswift-trt build`: a preset or local checkpoint -> a checked, self-describing engine directory.

Steps: resolve the checkpoint, check every weight's key and shape against the config (and the
preset's shape), write weights in the engine dtype (with `tp` > 1: one file per tensor-parallel rank,
each holding that rank's slices), copy the tokenizer, export ONNX / build TensorRT plans when asked,
hash every artifact into the manifest. Everything is written into a
temporary directory next to the target and renamed at the end, so a failed build leaves nothing
behind and never touches an existing engine (which is replaced only with `force`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenswift_trt.environment import checkpoint_home
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ConfigError, config_from_dict
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.draft_layers import DraftLayers, draft_key, heads_file_key
from tokenswift_trt.model.engine import (
    DEFAULT_HEADS_FILE,
    UntrainedDraftLayersWarning,
    has_draft_layers,
    load_engine,
)
from tokenswift_trt.model.engine_dir import BACKENDS, Manifest, record_artifacts, write_manifest
from tokenswift_trt.model.tensor_parallel import TensorParallelError, check_size, write_rank_files

from .gguf_import import GGUFImportError, import_gguf, read_source
from .presets import PRESETS, REPOSITORY, Preset
from .random_model import byte_level_tokenizer

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class BuildError(ValueError):
    """The build cannot proceed (the message names the fix)."""


@dataclass(frozen=True)
class BuildRequest:
    model: str  # preset name, a local Hugging Face directory, or a .gguf file (imported first)
    out: Path
    checkpoint: Path | None = None
    heads: Path | None = None
    backend: str = "torch"
    dtype: str | None = None  # default: the preset's (bfloat16 for the big models), else float32
    random_weights: bool = False
    force: bool = False
    max_sequence_length: int | None = None
    kernels: KernelConfig = KernelConfig()  # recorded in the manifest: the engine's default kernel settings
    tp: int = 1  # > 1: the weights split into one file per tensor-parallel rank (loaded with --tp tp)
    no_drafts: bool = False  # build a checkpoint without draft layers anyway (it then runs at AR speed)


def resolve(request: BuildRequest) -> tuple[Preset | None, Path | None]:
    """(preset or None, checkpoint dir or None for random weights), with clear errors."""
    if request.backend not in BACKENDS:
        raise BuildError(f"unknown backend {request.backend!r}; choose one of {', '.join(BACKENDS)}")
    preset = PRESETS.get(request.model)
    if preset is None:
        local = Path(request.model)
        if not local.is_dir():
            raise BuildError(
                f"unknown model {request.model!r}: give a preset ({', '.join(PRESETS)}) or a Hugging "
                "Face model directory"
            )
        return None, local
    if request.random_weights:
        return preset, None
    checkpoint = request.checkpoint
    if checkpoint is None:
        home = checkpoint_home()
        checkpoint = home / preset.name if home else None
        bundled = REPOSITORY / preset.bundled if preset.bundled else None
        if (
            (checkpoint is None or not (checkpoint / "config.json").is_file())
            and bundled
            and (bundled / "config.json").is_file()
        ):
            checkpoint = bundled  # the checkpoint this repository ships
    if checkpoint is None or not (checkpoint / "config.json").is_file():
        where = checkpoint if checkpoint is not None else f"$TOKENSWIFT_HOME/{preset.name}"
        raise BuildError(
            f"no checkpoint for {preset.name} at {where}: put {preset.hf_name}'s config.json, "
            "*.safetensors and "
            "tokenizer.json there, pass --checkpoint DIR, or use --random-weights"
        )
    return preset, checkpoint


def _check_against_preset(config: dict, preset: Preset, where: Path) -> None:
    for key in SHAPE_KEYS:
        if config.get(key) != preset.config.get(key) and not (
            key == "num_key_value_heads" and config.get(key) is None
        ):
            raise BuildError(
                f"{where}/config.json has {key}={config.get(key)}, but {preset.name} has {preset.config[key]}"
            )


def _tool_versions() -> dict[str, str]:
    versions = {"tokenswift-trt": metadata.version("tokenswift-trt"), "torch": torch.__version__}
    for package in ("onnx", "onnxruntime", "tensorrt"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _write_random_weights(config_dict: dict, dtype: torch.dtype, model_dir: Path, progress: Progress) -> None:
    config = config_from_dict(config_dict)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaModel(config, device="meta").state_dict().items()}
        draft_shapes = {k: v.shape for k, v in DraftLayers(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for index, (key, shape) in enumerate(shapes.items()):
        if key.endswith("norm.weight"):
            tensors[key] = torch.ones(shape, dtype=dtype)
        else:
            tensors[key] = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
        progress("random weights", index + 1, len(shapes))
    save_file(tensors, str(model_dir / "model.safetensors"))
    heads = {
        heads_file_key(k): (torch.ones(s) if "norm" in k else torch.zeros(s)).to(dtype)
        for k, s in draft_shapes.items()
    }
    save_file(heads, str(model_dir / DEFAULT_HEADS_FILE))


def _convert_weights(
    checkpoint: Path, dtype: torch.dtype, model_dir: Path, heads: Path | None, progress: Progress
) -> None:
    """Checkpoint shards -> model.safetensors (base) + heads.safetensors (draft layers), in `dtype`."""
    files = sorted(checkpoint.glob("*.safetensors"))
    files = [f for f in files if f.name != DEFAULT_HEADS_FILE]
    if not files:
        raise BuildError(
            f"no *.safetensors weights in {checkpoint}: expected model.safetensors or "
            "model-0000X-of-0000Y.safetensors"
        )
    base: dict[str, torch.Tensor] = {}
    draft: dict[str, torch.Tensor] = {}
    names = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.extend((path, key) for key in handle.keys())
    for index, (path, key) in enumerate(names):
        with safe_open(str(path), framework="pt") as handle:
            tensor = _in_dtype(handle.get_tensor(key), dtype)
        mapped = draft_key(key)
        if mapped is None:
            base[key] = tensor
        else:
            draft[heads_file_key(mapped)] = tensor
        progress("convert weights", index + 1, len(names))
    heads_source = heads or (
        checkpoint / DEFAULT_HEADS_FILE if (checkpoint / DEFAULT_HEADS_FILE).is_file() else None
    )
    if heads_source is not None:
        if not heads_source.is_file():
            raise BuildError(f"heads file {heads_source} does not exist")
        with safe_open(str(heads_source), framework="pt") as handle:
            draft = {
                heads_file_key(draft_key(k) or k): _in_dtype(handle.get_tensor(k), dtype)
                for k in handle.keys()
            }
    save_file(base, str(model_dir / "model.safetensors"))
    if draft:
        save_file(draft, str(model_dir / DEFAULT_HEADS_FILE))


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weights in the engine's dtype; integer tensors (a draft vocabulary's token ids) as they are."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def is_gguf(model: str) -> bool:
    """Whether a `--model` value names a GGUF file (which the build imports first)."""
    return model.lower().endswith(".gguf")


def _check_out(request: BuildRequest) -> None:
    out = request.out
    if out.exists() and any(out.iterdir()) and not request.force:
        raise BuildError(f"{out} already exists: pass --force to replace it")


def _build_from_gguf(request: BuildRequest, progress: Progress, log: Callable[[str], None] | None) -> Path:
    """Import the GGUF into a scratch Hugging Face directory next to the target, then build from it."""
    gguf = Path(request.model)
    if not gguf.is_file():
        raise BuildError(f"GGUF file {gguf} does not exist")
    if request.backend not in BACKENDS:
        raise BuildError(f"unknown backend {request.backend!r}; choose one of {', '.join(BACKENDS)}")
    _check_out(request)
    request.out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.gguf-", dir=request.out.parent))
    try:
        if log:
            log(f"importing {gguf} (dequantised to float32)")
        try:
            imported = import_gguf(gguf, scratch / gguf.stem, progress)
        except GGUFImportError as error:
            raise BuildError(str(error)) from None
        return _build(replace(request, model=str(imported)), None, imported, progress, log, name=gguf.stem)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def no_drafts_line(source: Path, command: str) -> str:
    """The one line that refuses to build or serve a model without draft layers, naming the ways out."""
    return (
        f"{source} has no draft layers, so TokenSwift would run at AR speed: pass the released TokenSwift "
        f"layers with --heads FILE, or train them (`tokenswift-trt train-heads --model-dir DIR --data TEXT "
        f"--out HEADS`, then --heads HEADS/heads.safetensors); or {command} it anyway with --no-drafts "
        "(AR speed, the same output)"
    )


def build_engine(
    request: BuildRequest, progress: Progress | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Build the engine directory `request.out`; returns it."""
    progress = progress or (lambda stage, done, total: None)
    if is_gguf(request.model):
        # a GGUF file holds no draft layers
        if request.heads is None and not request.no_drafts and Path(request.model).is_file():
            raise BuildError(no_drafts_line(Path(request.model), "build"))
        return _build_from_gguf(request, progress, log)
    preset, checkpoint = resolve(request)
    return _build(request, preset, checkpoint, progress, log)


def _build(
    request: BuildRequest,
    preset: Preset | None,
    checkpoint: Path | None,
    progress: Progress,
    log: Callable[[str], None] | None,
    name: str | None = None,
) -> Path:
    out = request.out
    _check_out(request)
    if checkpoint is not None:
        try:
            config_dict = json.loads((checkpoint / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise BuildError(f"cannot read {checkpoint}/config.json: {error}") from None
        if preset is not None:
            _check_against_preset(config_dict, preset, checkpoint)
        if not request.no_drafts and not has_draft_layers(checkpoint, request.heads):
            raise BuildError(no_drafts_line(checkpoint, "build"))
    else:
        assert preset is not None
        config_dict = dict(preset.config)
    try:
        model_config = config_from_dict(config_dict)
        if request.tp > 1:
            check_size(model_config, request.tp)
    except (ConfigError, TensorParallelError) as error:
        raise BuildError(str(error)) from None
    if request.tp > 1 and request.backend != "torch":
        raise BuildError(
            f"--tp {request.tp} splits a torch engine (ranks run the torch backend): drop --backend "
            f"{request.backend}"
        )
    dtype_name = request.dtype or (preset.dtype if preset else "float32")
    dtype = getattr(torch, dtype_name)
    defaults = dict(preset.defaults) if preset else {}
    lines: list[str] = []

    def note(message: str) -> None:
        lines.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}")
        if log:
            log(message)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        model_dir = staging / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        if checkpoint is None:
            note(f"random weights for {preset.name if preset else request.model} in {dtype_name}")
            _write_random_weights(config_dict, dtype, model_dir, progress)
            byte_level_tokenizer().save(str(model_dir / "tokenizer.json"))
        else:
            note(f"converting {checkpoint} to {dtype_name}")
            _convert_weights(checkpoint, dtype, model_dir, request.heads, progress)
            for file_name in TOKENIZER_FILES:
                if (checkpoint / file_name).is_file():
                    shutil.copy2(checkpoint / file_name, model_dir / file_name)
            if not (model_dir / "tokenizer.json").is_file():
                raise BuildError(
                    f"no tokenizer.json in {checkpoint}: copy the checkpoint's tokenizer files there"
                )
        try:  # every key and shape, base and draft layers, exactly as the runtime will load them
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UntrainedDraftLayersWarning)
                engine = load_engine(model_dir, dtype=dtype, kernels=request.kernels)
        except ValueError as error:
            raise BuildError(f"checkpoint check failed: {error}") from None
        for warning in caught:
            note(f"warning: {str(warning.message).replace(str(staging), str(out))}")
        note(
            f"weights checked: {len(engine.draft_layers)} draft layers, trained={engine.trained_draft_layers}"
        )
        plugin_library = None
        if request.backend == "tensorrt":
            from .tensorrt_build import find_plugin_library

            plugin_library = find_plugin_library()
            note(
                f"attention through the TokenSwift plugins in {plugin_library}"
                if plugin_library
                else "no plugin library (make plugins with TENSORRT_ROOT set): attention through "
                "TensorRT's own layers"
            )
        if request.backend in ("onnx", "tensorrt"):
            from .onnx_export import export_onnx

            note("exporting verify.onnx and draft.onnx")
            progress("export onnx", 0, 1)
            export_onnx(
                engine.model, engine.draft_layers, staging / "onnx", plugins=plugin_library is not None
            )
            progress("export onnx", 1, 1)
        max_len = request.max_sequence_length or engine.config.max_position_embeddings
        if request.backend == "tensorrt":
            from tokenswift_trt.backends.tensorrt_backend import MAX_PLAN_TOKENS, PLUGIN_LIBRARY_NAME

            from .tensorrt_build import build_plan

            if plugin_library is not None:  # the engine dir carries the plugins its plans need
                (staging / "tensorrt").mkdir(parents=True, exist_ok=True)
                shutil.copy2(plugin_library, staging / "tensorrt" / PLUGIN_LIBRARY_NAME)
            for graph, with_mask, max_tokens in (("verify", True, MAX_PLAN_TOKENS), ("draft", False, 1)):
                note(f"building tensorrt/{graph}.plan")
                build_plan(
                    staging / "onnx" / f"{graph}.onnx",
                    staging / "tensorrt" / f"{graph}.plan",
                    engine.config,
                    dtype_name,
                    max_tokens,
                    max_len,
                    with_mask,
                    plugin_library,
                )
        tp: dict = {}
        if request.tp > 1:  # each rank's slices in its own file, in place of the whole weights
            note(f"splitting the weights into {request.tp} tensor-parallel rank files")
            written = write_rank_files(
                [model_dir / "model.safetensors"], staging / f"model/tp-{request.tp}", request.tp
            )
            (model_dir / "model.safetensors").unlink()
            tp = {"size": request.tp, "shards": [path.relative_to(staging).as_posix() for path in written]}
        source = read_source(checkpoint) if checkpoint is not None else None  # a GGUF import's origin
        manifest = Manifest(
            name=name or (preset.name if preset else Path(request.model).name),
            architecture=engine.config.architecture,
            config=config_dict,
            dtype=dtype_name,
            backend=request.backend,
            max_sequence_length=max_len,
            defaults=defaults,
            random_weights=checkpoint is None,
            tool_versions=_tool_versions(),
            source={"gguf": source.file, "sha256": source.sha256} if source else {},
            kernels=request.kernels.to_dict(),
            tp=tp,
        )
        note("hashing artifacts")
        record_artifacts(staging, manifest)
        write_manifest(staging, manifest)
        (staging / "build.log").write_text("\n".join(lines) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out
