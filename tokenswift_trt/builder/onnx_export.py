"""Export the draft and verify forwards to ONNX with KV caches as explicit inputs and outputs.

Both graphs run the runtime's own `LlamaModel.decode` (the same code the torch backend runs) over
a cache object that concatenates past K/V with the new tokens' K/V and hands the new ones out:

- verify.onnx: tokens [T], positions [T], past_keys/past_values [layers, kv_heads, P, head_dim],
  tree_mask [T, T] bool -> hidden [T, hidden] (pre-norm), new_keys/new_values
  [layers, kv_heads, T, head_dim], queries [layers, T, heads, head_dim].
- draft.onnx: tokens [T], positions [T], past_keys/past_values (the partial cache) ->
  head_logits [1 + draft layers, T, vocab], new_keys, new_values.
T and P are dynamic.

With `plugins=True` (TensorRT engines) attention is exported as one `TokenSwiftTreeAttention`
node per layer (domain and plugin namespace `tokenswift`, plugin_version "1"; INT attributes
num_heads, num_kv_heads, head_dim and FLOAT scale), which TensorRT's ONNX parser maps to the
plugin in plugins_cuda/tensorrt once the plugin library is loaded; T is then at most 256.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.decoder import LlamaModel
from tokenswift_trt.model.draft_layers import DraftLayers

PLUGIN_DOMAIN = "tokenswift"
TREE_ATTENTION_PLUGIN = "TokenSwiftTreeAttention"


class ConcatCache:
    """Functional cache for export: attends to past + new, records the new K/V."""

    def __init__(self, past_keys: torch.Tensor, past_values: torch.Tensor) -> None:
        self.past_keys, self.past_values = past_keys, past_values  # [layers, kv_heads, P, head_dim]
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    @property
    def prefix_length(self) -> int:
        return self.past_keys.shape[2]

    def attend_kv(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.new_keys.append(keys)
        self.new_values.append(values)
        return torch.cat((self.past_keys[layer], keys), dim=1), torch.cat(
            (self.past_values[layer], values), dim=1
        )


class VerifyGraph(nn.Module):
    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, past_keys, past_values, tree_mask):
        cache = ConcatCache(past_keys, past_values)
        out = self.model.decode(tokens, positions, cache, tree_mask, keep_queries=True)
        assert out.queries is not None
        return (
            out.hidden,
            torch.stack(cache.new_keys),
            torch.stack(cache.new_values),
            torch.stack(out.queries),
        )


class DraftGraph(nn.Module):
    def __init__(self, model: LlamaModel, draft_layers: DraftLayers) -> None:
        super().__init__()
        self.model, self.draft_layers = model, draft_layers

    def forward(self, tokens, positions, past_keys, past_values):
        cache = ConcatCache(past_keys, past_values)
        hidden = self.model.decode(tokens, positions, cache).hidden
        return (
            self.model.head_logits(hidden, self.draft_layers),
            torch.stack(cache.new_keys),
            torch.stack(cache.new_values),
        )


VERIFY_INPUTS = ["tokens", "positions", "past_keys", "past_values", "tree_mask"]
VERIFY_OUTPUTS = ["hidden", "new_keys", "new_values", "queries"]
DRAFT_INPUTS = ["tokens", "positions", "past_keys", "past_values"]
DRAFT_OUTPUTS = ["head_logits", "new_keys", "new_values"]


def _examples(model: LlamaModel, dtype: torch.dtype, tokens: int = 3, past: int = 5):
    c = model.config
    kv = torch.zeros(c.num_layers, c.num_kv_heads, past, c.head_dim, dtype=dtype)
    return (
        torch.arange(tokens, dtype=torch.long),
        torch.arange(past, past + tokens, dtype=torch.long),
        kv,
        kv.clone(),
    )


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter logs and warns about internals a user cannot act on; keep the build output readable."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def plugin_translation_table(config: ModelConfig) -> dict:
    """Exporter translation: torch.ops.tokenswift.tree_attention -> a TokenSwiftTreeAttention node."""
    import onnxscript
    from onnx.defs import OpSchema

    tensor, attribute = OpSchema.FormalParameter, OpSchema.Attribute
    schema = OpSchema(
        TREE_ATTENTION_PLUGIN,
        PLUGIN_DOMAIN,
        1,
        inputs=[tensor("query", "T"), tensor("keys", "T"), tensor("values", "T"), tensor("tree_mask", "M")],
        outputs=[tensor("output", "T")],
        type_constraints=[
            ("T", ["tensor(float16)", "tensor(bfloat16)", "tensor(float)"], "activations"),
            ("M", ["tensor(int32)"], "packed tree mask"),
        ],
        attributes=[
            attribute(name, kind, "")
            for name, kind in (
                ("num_heads", OpSchema.AttrType.INT),
                ("num_kv_heads", OpSchema.AttrType.INT),
                ("head_dim", OpSchema.AttrType.INT),
                ("scale", OpSchema.AttrType.FLOAT),
                ("plugin_version", OpSchema.AttrType.STRING),
                ("plugin_namespace", OpSchema.AttrType.STRING),
            )
        ],
    )
    node = onnxscript.values.Op(
        onnxscript.values.Opset(PLUGIN_DOMAIN, 1), TREE_ATTENTION_PLUGIN, op_schema=schema
    )

    def tree_attention(query, keys, values, tree_mask, scale: float):
        return node(
            query,
            keys,
            values,
            tree_mask,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            scale=scale,
            plugin_version="1",
            plugin_namespace=PLUGIN_DOMAIN,
        )

    return {torch.ops.tokenswift.tree_attention.default: tree_attention}


def export_onnx(
    model: LlamaModel, draft_layers: DraftLayers, out_dir: Path, plugins: bool = False
) -> list[Path]:
    """Write verify.onnx and draft.onnx (weights inside each file; fp32/fp16/bf16 as the model is).

    plugins: attention as TensorRT plugin nodes (see the module docstring) instead of ONNX ops.
    """
    previous, fused = model.attention_kernel, model.fused_elementwise
    with _quiet_exporter():
        try:
            # the graph's attention: plugin nodes, or ONNX ops traced from SDPA (the compiled CPU
            # kernel the engine may verify with here is not exportable); norms and rotary as plain ONNX ops
            model.use_attention_kernel("tree_attention" if plugins else "sdpa")
            model.use_fused_elementwise(False)
            return _export(model, draft_layers, out_dir, plugins)
        finally:
            model.use_attention_kernel(previous)
            model.use_fused_elementwise(fused)


def _export(model: LlamaModel, draft_layers: DraftLayers, out_dir: Path, plugins: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    translations = plugin_translation_table(model.config) if plugins else None
    tokens = torch.export.Dim("tokens", min=1, max=kernels.MAX_TREE_TOKENS if plugins else 4096)
    past = torch.export.Dim("past", min=1, max=1 << 20)
    kv_shape = {2: past}
    written = []
    with torch.no_grad():
        examples = _examples(model, dtype)
        verify_args = (*examples, torch.ones(3, 3, dtype=torch.bool).tril())
        verify_shapes = ({0: tokens}, {0: tokens}, kv_shape, kv_shape, {0: tokens, 1: tokens})
        path = out_dir / "verify.onnx"
        torch.onnx.export(
            VerifyGraph(model).eval(),
            verify_args,
            str(path),
            input_names=VERIFY_INPUTS,
            output_names=VERIFY_OUTPUTS,
            dynamic_shapes=verify_shapes,
            dynamo=True,
            external_data=False,
            verbose=False,
            custom_translation_table=translations,
        )
        written.append(path)
        draft_shapes = ({0: tokens}, {0: tokens}, kv_shape, kv_shape)
        path = out_dir / "draft.onnx"
        torch.onnx.export(
            DraftGraph(model, draft_layers).eval(),
            examples,
            str(path),
            input_names=DRAFT_INPUTS,
            output_names=DRAFT_OUTPUTS,
            dynamic_shapes=draft_shapes,
            dynamo=True,
            external_data=False,
            verbose=False,
            custom_translation_table=translations,
        )
        written.append(path)
    return written
