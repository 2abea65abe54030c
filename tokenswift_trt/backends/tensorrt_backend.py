"""Execute TensorRT plans of the draft and verify graphs (TensorRT >= 10 Python API, CUDA only).

Same contract as the onnx backend: the caches stay runtime-owned torch tensors on the GPU; each
call binds the committed K/V as inputs and writes the new K/V into the cache's pending slots.
Imported lazily: machines without `tensorrt` never load this module's dependency.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenswift_trt.model.decoder import AttentionCache, ForwardOutput, GraphDecoder, LlamaModel


class TensorRTBackendError(RuntimeError):
    """TensorRT or CUDA is unavailable, or a plan cannot be loaded."""


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise TensorRTBackendError(
            "the tensorrt backend needs the `tensorrt` package (>= 10) and a CUDA GPU: install it on "
            "the GPU node, "
            "or build with --backend onnx / torch"
        ) from None
    return tensorrt


_TORCH_DTYPES = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "BOOL": torch.bool,
}


class _PlanRunner:
    """One deserialised plan with its execution context; runs with torch CUDA tensors as buffers."""

    def __init__(self, trt, runtime, path: Path) -> None:
        if not path.is_file():
            raise TensorRTBackendError(
                f"missing TensorRT plan {path}: rebuild the engine with --backend tensorrt"
            )
        self.trt = trt
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise TensorRTBackendError(
                f"TensorRT could not deserialise {path} (built by another TensorRT version?)"
            )
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        stream = torch.cuda.current_stream()
        for name in self.inputs:
            tensor = feeds[name].contiguous()
            feeds[name] = tensor
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        results = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            dtype = _TORCH_DTYPES[self.engine.get_tensor_dtype(name).name]
            results[name] = torch.empty(shape, dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, results[name].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise TensorRTBackendError("TensorRT execution failed")
        return results


PLUGIN_LIBRARY_NAME = "libtokenswift_trt_plugins.so"  # built by `make plugins`; copied into engine dirs
MAX_PLAN_TOKENS = 256  # the verify plan's profile (and the tree-attention plugin's) largest T


class TensorRTDecoder(GraphDecoder):
    """Drop-in for `LlamaModel` in decoding, running verify.plan and draft.plan.

    The plugin library (when the plans use our plugins) is loaded from `plan_dir` before the plans
    are deserialised; forwards take at most MAX_PLAN_TOKENS tokens (prefill runs in such chunks).
    """

    max_tokens = MAX_PLAN_TOKENS

    def __init__(self, torch_model: LlamaModel, plan_dir: Path) -> None:
        trt = import_tensorrt()
        if not torch.cuda.is_available():
            raise TensorRTBackendError("the tensorrt backend needs a CUDA GPU; none is visible")
        logger = trt.Logger(trt.Logger.WARNING)
        plugin_library = plan_dir / PLUGIN_LIBRARY_NAME
        if plugin_library.is_file():
            trt.get_plugin_registry().load_library(str(plugin_library))
        runtime = trt.Runtime(logger)
        super().__init__(torch_model)
        self.verify_plan = _PlanRunner(trt, runtime, plan_dir / "verify.plan")
        self.draft_plan = _PlanRunner(trt, runtime, plan_dir / "draft.plan")

    def __call__(self, tokens, positions, cache, tree_mask=None, keep_queries=False) -> ForwardOutput:
        count = tokens.shape[0]
        if tree_mask is None:
            tree_mask = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril()
        keys, values = cache.committed_kv()
        out = self.verify_plan.run(
            {
                "tokens": tokens,
                "positions": positions,
                "past_keys": keys,
                "past_values": values,
                "tree_mask": tree_mask,
            }
        )
        self.write_back(cache, out["new_keys"], out["new_values"])
        queries = list(out["queries"]) if keep_queries else None
        return ForwardOutput(hidden=out["hidden"], queries=queries)

    def draft(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: AttentionCache, draft_layers: nn.Module
    ) -> torch.Tensor:
        keys, values = cache.committed_kv()
        out = self.draft_plan.run(
            {"tokens": tokens, "positions": positions, "past_keys": keys, "past_values": values}
        )
        self.write_back(cache, out["new_keys"], out["new_values"])
        return out["head_logits"][:, -1]
