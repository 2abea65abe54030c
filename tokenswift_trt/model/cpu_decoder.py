"""The decoder stack of a CPU float32 engine in one compiled call for a few new tokens.

An AR step or a tree verification of a small model on a CPU spends as long around its products as
in them: per layer ~25 PyTorch operations (norms, views, rotary, cache writes, residual adds), each
a Python call and an ATen dispatch, cost about as much as the layer's products for a model of
SmolLM2-135M's size. `CpuDecoder` runs the whole stack for up to TILED_MAX_ROWS tokens in
plugins_cuda/cpu/decoder_cpu.cpp over the weights `LlamaModel.pack()` prepacked (tiled layout),
writing the new K/V into the full cache's pending slots as `KVCache.attend_kv` would. It computes
the same function as `LlamaModel.decode` (tested against it) and is batch-invariant like the
tiled products: every step is per row.

Used only where it applies: float32 on a CPU with the tiled kernel (`linear.tiled_kernels`),
inference mode, every product packed, the plain full cache (`KVCache`), and weights unchanged
since packing; otherwise `LlamaModel.decode` runs its PyTorch code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import TILED_MAX_ROWS, FusedLinears, Linear, tiled_kernels


def _version(parameter: torch.Tensor) -> int | None:
    return None if parameter.is_inference() else parameter._version


class CpuDecoder:
    """Packed per-layer tensors of a decoder stack, in decoder_cpu.cpp's order, and the identities of
    the parameters they came from (any change turns the fused path off)."""

    def __init__(
        self,
        kernels,
        weights: list[torch.Tensor],
        sources: list[tuple[nn.Module, str]],
        config: ModelConfig,
    ):
        """`sources`: (module, attribute) of every parameter the packed tensors came from."""
        self.kernels, self.weights, self.config = kernels, weights, config
        # each parameter's own slot (the owner's `_parameters` dict: reading it skips nn.Module's
        # slow attribute lookup, which hundreds of parameters a step would pay), the
        # parameter packed from it (kept, so that its identity cannot be reused), its in-place version
        # (None for an inference tensor, which carries none and cannot be changed outside inference
        # mode) and dtype: cheaper to compare each step than fresh `weight_identity` tuples
        self._packed_from = [
            (slots, name, slots[name], _version(slots[name]), slots[name].dtype)
            for slots, name in ((owner._parameters, name) for owner, name in sources)
        ]

    @classmethod
    def pack(
        cls, layers: Sequence[nn.Module], config: ModelConfig, settings: KernelConfig = KernelConfig()
    ) -> CpuDecoder | None:
        """From decoder layers whose Q/K/V and gate/up are fused and whose products are in the tiled
        layout (`LlamaModel.pack()` on a float32 CPU engine); None where any is not."""
        kernels = tiled_kernels(settings)
        if kernels is None:
            return None
        weights: list[torch.Tensor] = []
        sources: list[tuple[nn.Module, str]] = []
        for layer in layers:
            attention, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(norm.dtype != torch.float32 or norm.device.type != "cpu" for norm in norms):
                return None
            products = (attention.fused, attention.o_proj, mlp.fused, mlp.down_proj)
            packed = [_tiled(product) for product in products]
            if any(item is None for item in packed):
                return None
            (qkv, qkv_bias), (out, out_bias), (gate_up, gate_up_bias), (down, down_bias) = packed
            weights += [
                norms[0],
                qkv,
                qkv_bias,
                out,
                out_bias,
                norms[1],
                gate_up,
                gate_up_bias,
                down,
                down_bias,
            ]
            sources += [
                (owner, name)
                for owner in layer.modules()
                for name, _ in owner.named_parameters(recurse=False)
            ]
        return cls(kernels, weights, sources, config)

    def usable(self, count: int, cache: object) -> bool:
        """Whether `count` new tokens on `cache` take this path now."""
        return self.fits(count, cache) and self.ready()

    @staticmethod
    def fits(count: int, cache: object) -> bool:
        """Whether `count` new tokens on `cache` are a call of this decoder (`ready` aside)."""
        return count <= TILED_MAX_ROWS and type(cache) is KVCache

    def ready(self) -> bool:
        """Whether this decoder runs now: in inference mode, not compiling, its weights unchanged."""
        return torch.is_inference_mode_enabled() and not torch.compiler.is_compiling() and self._unchanged()

    def _unchanged(self) -> bool:
        """Every parameter is the one packed, at the same version and dtype."""
        for slots, name, parameter, version, dtype in self._packed_from:
            now = slots[name]
            if now is not parameter or now.dtype != dtype:
                return False
            if version is not None and now._version != version:
                return False
        return True

    def run(
        self,
        embeddings: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        cache: KVCache,
        attention: torch.Tensor,  # mode 0/1: SDPA's additive bias; mode 2: packed tree mask [T, words]
        mode: int,  # 0: SDPA with the query heads of a KV head folded into rows, 1: SDPA, 2: tree kernel
        scale: float,
        keep_queries: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """-> (hidden [T, hidden] before the final norm, per layer the rotated queries [T, heads, D]
        when `keep_queries`); the new K/V are the cache's pending slots."""
        c, count = self.config, embeddings.shape[0]
        start = cache.reserve(count)
        queries = (
            embeddings.new_empty(c.num_layers, count, c.num_heads, c.head_dim)
            if keep_queries
            else embeddings.new_empty(0)
        )
        hidden = self.kernels.decoder(
            embeddings.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            self.weights,
            cache.keys,
            cache.values,
            start,
            attention,
            mode,
            c.num_heads,
            c.num_kv_heads,
            c.rms_norm_eps,
            scale,
            queries,
        )
        return hidden, list(queries.unbind(0)) if keep_queries else None

    def run_batch(
        self,
        embeddings: torch.Tensor,  # [T, hidden]: the segments' rows one after another
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        caches: Sequence[KVCache],  # one per segment
        counts: Sequence[int],  # each segment's rows
        attention: Sequence[torch.Tensor],  # per segment as `run`'s `attention`
        modes: Sequence[int],  # per segment as `run`'s `mode`
        scale: float,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`run` for several requests' segments in one call: -> (hidden [T, hidden], per layer the
        rotated queries [T, heads, D]); segment s writes its new K/V into its own cache's pending slots."""
        c, count = self.config, embeddings.shape[0]
        starts = [cache.reserve(n) for cache, n in zip(caches, counts, strict=True)]
        assert sum(counts) == count, "the segments' rows must add up to the embeddings' rows"
        queries = embeddings.new_empty(c.num_layers, count, c.num_heads, c.head_dim)
        hidden = self.kernels.decoder_batch(
            embeddings.contiguous(),
            cos.contiguous(),
            sin.contiguous(),
            self.weights,
            [cache.keys for cache in caches],
            [cache.values for cache in caches],
            starts,
            list(counts),
            list(attention),
            list(modes),
            c.num_heads,
            c.num_kv_heads,
            c.rms_norm_eps,
            scale,
            queries,
        )
        return hidden, list(queries.unbind(0))


def _tiled(product: Linear | FusedLinears | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed weight, bias or an empty tensor) of a product packed in the tiled layout, else None."""
    if product is None:
        return None
    packed = product._packed
    if packed is None or packed.kind != "tiled":
        return None
    bias = product._bias if isinstance(product, FusedLinears) else product.bias
    return packed.data, packed.data.new_empty(0) if bias is None else bias.detach()
