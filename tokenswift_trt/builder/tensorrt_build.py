"""ONNX -> TensorRT plans with the `tensorrt` (>= 10) builder API: parser, precision flags and one
optimisation profile per graph covering tree sizes (tokens) and context lengths (past)."""

from __future__ import annotations

from pathlib import Path

from tokenswift_trt.backends.tensorrt_backend import PLUGIN_LIBRARY_NAME, import_tensorrt
from tokenswift_trt.environment import plugin_library
from tokenswift_trt.model.config import ModelConfig


def find_plugin_library() -> Path | None:
    """The TensorRT plugin library: $TOKENSWIFT_TRT_PLUGINS, else `make plugins`' output in this checkout."""
    configured = plugin_library()
    candidates = [configured] if configured else []
    candidates.append(Path(__file__).resolve().parents[2] / "build" / "plugins" / PLUGIN_LIBRARY_NAME)
    return next((path for path in candidates if path.is_file()), None)


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    config: ModelConfig,
    dtype: str,
    max_tokens: int,
    max_context: int,
    with_tree_mask: bool,
    plugin_library: Path | None = None,
    workspace_bytes: int = 8 << 30,
) -> Path:
    """plugin_library: loaded before parsing, so the ONNX parser maps TokenSwift nodes to our plugins."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    if plugin_library is not None:
        trt.get_plugin_registry().load_library(str(plugin_library))
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    builder_config = builder.create_builder_config()
    builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if dtype == "bfloat16":
        builder_config.set_flag(trt.BuilderFlag.BF16)
    elif dtype == "float16":
        builder_config.set_flag(trt.BuilderFlag.FP16)
    kv = (config.num_layers, config.num_kv_heads)
    opt_tokens, opt_context = min(64, max_tokens), min(32768, max_context)
    profile = builder.create_optimization_profile()
    profile.set_shape("tokens", (1,), (opt_tokens,), (max_tokens,))
    profile.set_shape("positions", (1,), (opt_tokens,), (max_tokens,))
    for name in ("past_keys", "past_values"):
        profile.set_shape(
            name,
            (*kv, 1, config.head_dim),
            (*kv, opt_context, config.head_dim),
            (*kv, max_context, config.head_dim),
        )
    if with_tree_mask:
        profile.set_shape("tree_mask", (1, 1), (opt_tokens, opt_tokens), (max_tokens, max_tokens))
    builder_config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, builder_config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build a plan from {onnx_path} (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(plan))
    return plan_path
