"""One decoder for the Llama family (Llama 2 / 3.x, Qwen2; MHA and GQA), driven by `ModelConfig`.

Every call takes explicit position ids and an optional tree mask among the new tokens, and
attends to whatever cache it is given (full cache for prefill/verify/AR, partial cache for
drafting). Parameter names equal Hugging Face's, so checkpoints load key for key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenswift_trt.kernels import cascade, prefix_config
from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.kernels.ops import apply_rotary
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.cpu_decoder import CpuDecoder
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.linear import FusedLinears, Linear, batch_invariant_product, pack_linears
from tokenswift_trt.model.rope import RotaryEmbedding
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.model.screened_head import ScreenedHead
from tokenswift_trt.model.tensor_parallel import VocabParallelHead

# How attention runs: "sdpa" (torch's scaled_dot_product_attention with a boolean mask; CPU and any
# device) or "tree_attention" (torch.ops.tokenswift.tree_attention with a packed tree mask; the
# CUDA kernel where loaded, the PyTorch reference elsewhere). Both compute the same function.
# "cpu_tree_attention": the compiled CPU kernel (kernels.cpu_tree_attention) for 1..256 new tokens
# (AR steps too: with its prefetch it beats SDPA for one token, docs/runtime.md), SDPA for longer
# prefill chunks.
ATTENTION_KERNELS = ("sdpa", "tree_attention", "cpu_tree_attention", "flash_cascade")
ALIGNED_MAX_LEVELS = 64  # position-aligned attention: nodes at depths 0..63 (`triton_aligned`)


def aligned_fits(tree_mask: torch.Tensor) -> bool:
    """Whether every node of a host tree mask [T, T] (a node sees its ancestors and itself) is
    shallower than ALIGNED_MAX_LEVELS levels, as position-aligned attention needs."""
    return int(tree_mask.sum(1).max()) <= ALIGNED_MAX_LEVELS


CPU_KERNEL_MIN_TOKENS = 1
PACKED_MASK_MEMO = 256  # packed tree masks kept per model (CPU kernel)
GQA_FOLD_MAX_TOKENS = 8  # see grouped_sdpa


class AttentionCache(Protocol):
    """What a forward needs of a cache: the committed length and a write-then-read per layer."""

    @property
    def prefix_length(self) -> int: ...

    def attend_kv(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden] last layer output before the final norm
    queries: list[torch.Tensor] | None  # per layer [T, heads, head_dim] after rotary, when requested


@dataclass
class Segment:
    """One request's new tokens in a batched forward (`forward_batch`): its own cache, positions and
    tree mask; the requests' rows go through every product together and attend each to its own cache."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 absolute positions
    cache: AttentionCache
    tree_mask: torch.Tensor | None = None  # [T, T] bool on the model's device, None = causal


def forward_batch(model: Decoder, segments: Sequence[Segment]) -> list[ForwardOutput]:
    """Every segment's forward (hidden states and queries kept), in one pass where the model batches
    requests (`LlamaModel.forward_batch`), else one forward per segment. Each segment's outputs are the
    bits its own forward gives."""
    batched = getattr(model, "forward_batch", None)
    if batched is not None:
        return batched(segments)
    return [model(s.tokens, s.positions, s.cache, tree_mask=s.tree_mask, keep_queries=True) for s in segments]


class Decoder(Protocol):
    """What decoding needs of a model. `LlamaModel` (torch) implements it, and so do the decoders
    that run exported graphs (onnxruntime, TensorRT; `GraphDecoder`) with the torch model's weights
    for the norm, LM head and draft heads."""

    config: ModelConfig
    max_tokens: int | None  # most new tokens one forward takes (exported plans bound T); None = any
    fixed_shape_steps: bool  # whether static_step.StaticForward may run `torch_model` in its place

    @property
    def torch_model(self) -> LlamaModel: ...

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None = None,
        keep_queries: bool = False,
    ) -> ForwardOutput: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def target_logits(
        self, hidden: torch.Tensor, sampling: SamplingConfig, windows: torch.Tensor | None
    ) -> torch.Tensor: ...

    def head_logits(
        self,
        hidden: torch.Tensor,
        draft_layers: nn.Module,
        depth: int | None = None,
        choose_root: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def draft_logits(
        self, hidden: torch.Tensor, draft_layers: nn.Module, depth: int, roots: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def draft(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: AttentionCache, draft_layers: nn.Module
    ) -> torch.Tensor: ...

    def path_logits(
        self, states: torch.Tensor, draft_layers: nn.Module, tokens: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def reads_root(draft_layers: nn.Module) -> bool:
    """Whether draft layers are root-conditioned (`draft_layers.DraftLayers(root_conditioned=True)`):
    they then also read the token after each row's own."""
    return bool(getattr(draft_layers, "root_conditioned", False))


def drafts_along_paths(draft_layers: nn.Module) -> bool:
    """Whether draft layers have a path input (`draft_layers.PathInput`): trees deeper than one level
    are then drafted level by level, each node's children from its own path (`stages.path_candidates`)."""
    return getattr(draft_layers, "path", None) is not None


def vocab_head(draft_layers: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The head over the draft layers' vocabulary (`draft_layers.VocabHead`: logits [..., V] from the
    LM head's rows of the most frequent tokens), or None: draft through the whole LM head."""
    return getattr(draft_layers, "vocab_head", None)


@dataclass
class AttentionMask:
    """What attention needs besides Q/K/V, by kernel:
    - "sdpa": `mask` [T, keys] bool, True = may attend (keys = what attend_kv returned), and
      `bias`, the same mask as the additive float bias grouped_sdpa takes (`sdpa_bias`), built
      once per forward rather than converted by SDPA in every layer;
    - "tree_attention": `mask` [T, ceil(T/32)] int32 packed tree mask, the cache prefix all visible;
    - "tree_attention_static": the same packed mask, keys span a whole-capacity cache and
      `prefix_length` (0-d int32, on the device) says where the tree's own K/V start;
    - "flash_cascade": `mask` [T, T] bool on the device (the tree among itself), `prefix_length` as
      above (0-d, on the device, static or not), `splits` key ranges of the FlashAttention prefix
      block (`cascade.flash_cascade_attention`);
    - "aligned": `mask` and `prefix_length` as for the cascade; position-aligned attention
      (`triton_aligned.tree_attention_aligned`: a row's bits as an AR step's at its position).
    """

    kernel: str
    mask: torch.Tensor
    prefix_length: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    splits: int = 1
    fused_tail: bool = False  # flash_cascade: the tree block and merge as one op (`cascade.cascade_tail`)
    prefix_backend: str = "flash"  # flash_cascade: the prefix block's kernel, "flash" or "triton[:launch]"
    depths: torch.Tensor | None = None  # aligned: [T] int32 (`triton_aligned.tree_depths_and_ancestors`)
    ancestors: torch.Tensor | None = None  # aligned: [T, width] int32 cache slots


@dataclass
class StaticAttention:
    """Inputs of a fixed-shape forward over a whole-capacity cache (static_step.py)."""

    full_mask: torch.Tensor  # [T, capacity] bool: committed slots + the tree among the new slots
    tree_mask: torch.Tensor  # [T, T] bool on the device
    prefix_length: torch.Tensor  # 0-d int64 on the device: committed slots
    # the FlashAttention cascade or not, as the caller chose from the committed length it knows
    # (`LlamaModel.cascade_route`); None: by T x the cache's capacity (a dynamic forward: its keys)
    cascade: bool | None = None
    # position-aligned attention allowed: the caller knows every node is shallower than 64 levels
    # (`triton_aligned`); False where it does not (a long causal chain)
    aligned: bool = False


@dataclass
class PackedProjection:
    """Linears that read the same input as one product: their weights concatenated into one tensor
    whose row blocks are the parts' own weights (views: no second copy), and the output sizes."""

    weight: torch.Tensor  # [sum(out), in]
    bias: torch.Tensor | None  # [sum(out)]
    sizes: list[int]
    batch_invariant: bool = False  # CUDA: the product through `triton_linear` (as `Linear.batch_invariant`)

    @classmethod
    def share(cls, parts: Sequence[nn.Linear]) -> PackedProjection:
        """Concatenate the parts' weights (and biases) and make each part's parameter a view of its
        block; the old tensors are freed with the parameters that held them."""
        sizes = [part.out_features for part in parts]
        with torch.no_grad():
            weight = torch.cat([part.weight for part in parts])
            biases = [part.bias for part in parts]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            start = 0
            for part, size in zip(parts, sizes):
                part.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
                if bias is not None:
                    part.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
                start += size
        return cls(weight, bias, sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant and x.is_cuda:
            return batch_invariant_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)  # [..., sum(out)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.row_wise = False  # through the one-block-per-row kernel (`LlamaModel.use_batch_invariant`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_wise and x.is_cuda and x.dim() == 2:  # PyTorch's reduction may split a lone row
            return kernels.add_rms_norm(x, None, self.weight, self.eps)[1]
        return kernels.rms_norm_reference(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear(config.hidden_size, config.num_heads * config.head_dim, bias=config.qkv_bias)
        self.k_proj = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.v_proj = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=config.qkv_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.fused: FusedLinears | None = None  # Q/K/V as one packed product on a CPU (`pack`)
        self.fused_rotary = False  # q and k rotated by one op (`LlamaModel.use_fused_elementwise`)
        self.qkv: PackedProjection | None = None  # Q/K/V as one product (`LlamaModel.use_fused_elementwise`)

    def pack(self, settings: KernelConfig = KernelConfig()) -> None:
        self.fused = FusedLinears.pack([self.q_proj, self.k_proj, self.v_proj], settings)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: AttentionCache,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention output after o_proj [T, hidden], rotated queries [T, heads, head_dim])."""
        q, k, v = self.project(x)
        out, q = self.attend(q, k, v, cos, sin, mask, cache, layer)
        return self.o_proj(out), q

    def forward_segments(
        self,
        x: torch.Tensor,  # [T, hidden]: the segments' rows one after another
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        counts: Sequence[int],  # each segment's rows
        masks: Sequence[AttentionMask],  # one per segment
        caches: Sequence[AttentionCache],
        layer: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` for several requests' segments: the products over all rows at once, attention per
        segment on its own cache. -> (output [T, hidden], per segment its rotated queries)."""
        parts = zip(
            *(t.split(list(counts)) for t in (*self.project(x), cos, sin)), masks, caches, strict=True
        )
        outs, queries = [], []
        for q, k, v, c, s, mask, cache in parts:
            out, q = self.attend(q, k, v, c, s, mask, cache, layer)
            outs.append(out)
            queries.append(q)
        return self.o_proj(torch.cat(outs)), queries

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads * D], k and v [T, kv_heads * D]."""
        if self.fused is not None and self.fused.usable(x):
            return self.fused(x)
        if self.qkv is not None:
            return self.qkv(x).split(self.qkv.sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def attend(
        self,
        q: torch.Tensor,  # [T, heads * D]
        k: torch.Tensor,  # [T, kv_heads * D]
        v: torch.Tensor,
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: AttentionCache,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary, the cache's write-then-read and attention by `mask.kernel`: -> (output before o_proj
        [T, heads * D], rotated queries [T, heads, D])."""
        count = q.shape[0]
        q = q.view(count, self.num_heads, self.head_dim).transpose(0, 1)  # [heads, T, head_dim]
        k = k.view(count, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(count, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if self.fused_rotary:
            q, k = kernels.rotary_qk(q, k, cos, sin)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        keys, values = cache.attend_kv(layer, k, v)  # [kv_heads, prefix + T, head_dim]
        scale = kernels.default_scale(self.head_dim)
        if mask.kernel == "tree_attention":
            out = kernels.tree_attention(
                q.contiguous(), keys, values, mask.mask, scale
            )  # [heads, T, head_dim]
        elif mask.kernel == "cpu_tree_attention":
            out = kernels.cpu_tree_attention(q, keys, values, mask.mask, scale)
        elif mask.kernel == "tree_attention_static":
            assert mask.prefix_length is not None
            out = kernels.tree_attention_static(
                q.contiguous(), keys, values, mask.mask, mask.prefix_length, scale
            )
        elif mask.kernel == "aligned":
            assert mask.prefix_length is not None
            assert mask.depths is not None and mask.ancestors is not None
            from tokenswift_trt.kernels.triton_aligned import (
                tree_attention_aligned,  # Triton: CUDA builds of PyTorch only
            )

            out = tree_attention_aligned(
                q, keys, values, mask.prefix_length, mask.depths, mask.ancestors, scale
            )
        elif mask.kernel == "flash_cascade":
            assert mask.prefix_length is not None
            out = cascade.flash_cascade_attention(
                q,
                keys,
                values,
                mask.mask,
                mask.prefix_length,
                scale,
                mask.splits,
                mask.fused_tail,
                mask.prefix_backend,
            )
        else:
            assert mask.bias is not None
            out = grouped_sdpa(q, keys, values, mask.bias)
        return out.transpose(0, 1).reshape(count, self.num_heads * self.head_dim), q.transpose(0, 1)


def folds_groups(heads: int, kv_heads: int, count: int) -> bool:
    """Whether grouped_sdpa folds the query heads of a KV head into its rows for `count` new tokens."""
    return heads > kv_heads and count <= GQA_FOLD_MAX_TOKENS


def sdpa_bias(mask: torch.Tensor, heads: int, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [T, S] bool (True = may attend) -> additive bias (0 / -inf) in `dtype` for grouped_sdpa:
    [group·T, S] when it folds (row g·T + t is query t of head g in the group), else [T, S]."""
    count = mask.shape[0]
    if folds_groups(heads, kv_heads, count):
        mask = mask.repeat(heads // kv_heads, 1)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def grouped_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """q [heads, T, D], keys/values [kv_heads, S, D], bias from `sdpa_bias` -> [heads, T, D].

    Up to GQA_FOLD_MAX_TOKENS new tokens, the query heads sharing a KV head are folded into its
    query rows ([kv_heads, group·T, D]), so each K/V head is read once and never copied per query
    head; longer blocks (prefill, big trees) take SDPA's own GQA, which avoids the folded mask's
    group·T rows (folding pays for a few new tokens and costs more for many).
    """
    heads, count, dim = q.shape
    kv_heads = keys.shape[0]
    if not folds_groups(heads, kv_heads, count):
        gqa = heads > kv_heads
        return F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=bias, enable_gqa=gqa
        )[0]
    folded = q.reshape(kv_heads, (heads // kv_heads) * count, dim)
    out = F.scaled_dot_product_attention(folded[None], keys[None], values[None], attn_mask=bias)[0]
    return out.reshape(heads, count, dim)  # SDPA on CUDA may return a non-contiguous layout


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.fused: FusedLinears | None = None  # gate and up as one packed product on a CPU (`pack`)
        # gate and up as one product, its activation one op (`LlamaModel.use_fused_elementwise`)
        self.gate_up: PackedProjection | None = None

    def pack(self, settings: KernelConfig = KernelConfig()) -> None:
        self.fused = FusedLinears.pack([self.gate_proj, self.up_proj], settings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.usable(x):
            gate, up = self.fused(x)
        elif self.gate_up is not None:
            return self.down_proj(kernels.silu_mul(self.gate_up(x)))  # [T, 2 · inner] -> [T, inner]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_mask(
    prefix: int, tree_mask: torch.Tensor | None, count: int, device: torch.device
) -> torch.Tensor:
    """[T, prefix + T] bool: all committed slots, then the tree mask (causal when None)."""
    if tree_mask is None:
        tree_mask = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    visible_prefix = torch.ones(count, prefix, dtype=torch.bool, device=device)
    return torch.cat((visible_prefix, tree_mask.to(device)), dim=1)


class GraphDecoder:
    """Base of the decoders that run exported graphs (onnxruntime, TensorRT) behind `LlamaModel`'s
    interface: the runtime keeps its caches, the graph's new K/V are written into their pending
    slots, and norm, LM head and draft heads reuse the torch model's weights."""

    max_tokens: int | None = None
    fixed_shape_steps = False  # the graphs have their own shapes

    def __init__(self, torch_model: LlamaModel) -> None:
        self._torch_model = torch_model
        self.config = torch_model.config

    @property
    def torch_model(self) -> LlamaModel:
        return self._torch_model

    @staticmethod
    def write_back(cache: AttentionCache, new_keys: torch.Tensor, new_values: torch.Tensor) -> None:
        """new K/V [layers, kv_heads, T, head_dim] -> the cache's pending slots."""
        for layer in range(new_keys.shape[0]):
            cache.attend_kv(layer, new_keys[layer], new_values[layer])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.torch_model.logits(hidden)

    def target_logits(
        self, hidden: torch.Tensor, sampling: SamplingConfig, windows: torch.Tensor | None
    ) -> torch.Tensor:
        return self.torch_model.target_logits(hidden, sampling, windows)

    def head_logits(
        self,
        hidden: torch.Tensor,
        draft_layers: nn.Module,
        depth: int | None = None,
        choose_root: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.torch_model.head_logits(hidden, draft_layers, depth, choose_root)

    def draft_logits(
        self, hidden: torch.Tensor, draft_layers: nn.Module, depth: int, roots: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.torch_model.draft_logits(hidden, draft_layers, depth, roots)

    def path_logits(
        self, states: torch.Tensor, draft_layers: nn.Module, tokens: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.torch_model.path_logits(states, draft_layers, tokens, first)


class LlamaModel(nn.Module):
    """Decoder + LM head. `forward` returns pre-norm hidden states; `logits` applies norm + head."""

    max_tokens: int | None = None
    fixed_shape_steps = True

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, device="cpu" if str(device) == "meta" else device)
        self.attention_kernel = "sdpa"  # see ATTENTION_KERNELS; `use_attention_kernel` switches it
        self.cpu_decoder: CpuDecoder | None = None  # the compiled stack for a few CPU tokens (`pack`)
        self.screened_head: ScreenedHead | None = None  # the LM head for CPU sampling (`pack`)
        self.fused_elementwise = False  # fewer, fused ops per layer (`use_fused_elementwise`)
        self.batch_invariant = False  # CUDA products and norms row by row (`use_batch_invariant`)
        # a batch's forwards as one pass of the layers (`_batched_decode`; kernel setting batched_forward)
        self.batched_forward = False
        self.aligned_attention = False  # steps of <= 64 levels through `triton_aligned` (the same)
        # the FlashAttention cascade for T query rows over `capacity` keys only where T * capacity >=
        # this (`use_flash_cascade`); below it `cascade_fallback` runs (0: always the cascade)
        self.cascade_min_work = 0
        self.cascade_fallback = "sdpa"
        self.cascade_fused_tail = False  # its tree block and merge as one op (`cascade.cascade_tail`)
        self.cascade_prefix = "flash"  # its prefix block's kernel: "flash" or "triton[:launch]"
        self._packed_masks: dict[
            tuple[int, bytes], torch.Tensor
        ] = {}  # CPU kernel: packed tree masks by bits

    @property
    def torch_model(self) -> LlamaModel:
        return self

    def use_batch_invariant(self, on: bool, attention: bool = True) -> None:
        """On CUDA, every product of the base model and its LM head through `triton_linear` (up to 256
        rows) and every RMSNorm one block per row: a row's bits then do not depend on how many rows a
        step has; with `attention`, steps also attend position-aligned (`triton_aligned`), so an AR step
        and a verify compute the same logits (docs/method.md, "In bf16 on a GPU").
        Draft layers keep cuBLAS: drafts never change the output."""
        self.batch_invariant = on
        self.aligned_attention = on and attention and self.config.head_dim in prefix_config.ALIGNED_HEAD_DIMS
        for module in [*self.model.modules(), self.lm_head]:
            if isinstance(module, Linear):
                module.batch_invariant = on
            elif isinstance(module, RMSNorm):
                module.row_wise = on
        for layer in self.model.layers:
            for packed in (layer.self_attn.qkv, layer.mlp.gate_up):
                if packed is not None:
                    packed.batch_invariant = on

    def use_fused_elementwise(self, on: bool) -> None:
        """Fewer, larger kernels per layer (#20, "AR at the floor"): residual add + RMSNorm, the q/k
        rotary embedding and SiLU·up as one op each (`kernels.add_rms_norm`, `.rotary_qk`, `.silu_mul`:
        one CUDA kernel each, the PyTorch composition elsewhere), Q/K/V and gate/up as one product each
        (their weights concatenated in place, `PackedProjection.share`; they stay so when turned off).
        Call it once the weights are on their device: moving the model afterwards splits the views."""
        self.fused_elementwise = on
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.fused_rotary = on
            if on and attention.qkv is None:
                attention.qkv = PackedProjection.share([attention.q_proj, attention.k_proj, attention.v_proj])
                mlp.gate_up = PackedProjection.share([mlp.gate_proj, mlp.up_proj])
                attention.qkv.batch_invariant = mlp.gate_up.batch_invariant = self.batch_invariant
            elif not on:
                attention.qkv, mlp.gate_up = None, None

    def use_flash_cascade(self, min_work: int, fallback: str) -> None:
        """Verify through the FlashAttention cascade where T query rows over `capacity` keys make
        T * capacity >= `min_work`, and through `fallback` ("tree_attention" or "sdpa") otherwise: the
        cascade's tree block and merge cost a fixed amount per layer, which only long contexts
        and wide trees repay (docs/bench/gpu-h200-variants)."""
        if fallback not in ("tree_attention", "sdpa"):
            raise ValueError(f"the cascade's fallback must be tree_attention or sdpa, got {fallback!r}")
        self.attention_kernel = "flash_cascade"
        self.cascade_min_work, self.cascade_fallback = min_work, fallback

    def cascade_route(self, count: int, committed: int) -> bool | None:
        """For a fixed-shape forward of `count` rows after `committed` keys, as its caller knows them:
        whether it takes the FlashAttention cascade (T x keys >= `cascade_min_work`), or None where the
        model is not on the cascade. A captured graph holds one route: callers keep a graph per route,
        so that a long generation from a short prompt starts on the kernel and moves to the cascade
        once its context makes the cascade pay."""
        if self.attention_kernel != "flash_cascade" or count > kernels.MAX_TREE_TOKENS:
            return None
        return count * (committed + count) >= self.cascade_min_work

    def attention_summary(self) -> str:
        """What verifies, for bench records: the kernel, and for the cascade where it applies."""
        if self.attention_kernel != "flash_cascade":
            name = self.attention_kernel
        else:
            name = "flash_cascade" + (", triton prefix" if self.cascade_prefix.startswith("triton") else "")
            name += ", fused tail" if self.cascade_fused_tail else ""
            if self.cascade_min_work > 0:
                name = f"{name} where T x keys >= {self.cascade_min_work}, else {self.cascade_fallback}"
        if self.aligned_attention:
            return f"position-aligned for steps of < {ALIGNED_MAX_LEVELS} levels, else {name}"
        return name

    def use_attention_kernel(self, kernel: str) -> None:
        """Switch the attention kernel (ATTENTION_KERNELS). "flash_cascade" keeps the cascade's threshold
        and fallback as `use_flash_cascade` last set them (0 and SDPA unless set: every tree)."""
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}"
            )
        self.attention_kernel = kernel

    def pack(self, settings: KernelConfig = KernelConfig()) -> int:
        """For CPU inference: prepack every linear (linear.py), then fuse each layer's Q/K/V and
        gate/up products; returns how many linears were packed (0 off the CPU). `settings`: the CPU
        kernel, huge-page and screened-head choices."""
        count = pack_linears(self, kernels=settings)
        for layer in self.model.layers:
            layer.self_attn.pack(settings)
            layer.mlp.pack(settings)
        self.cpu_decoder = CpuDecoder.pack(self.model.layers, self.config, settings)
        # a head split over the vocabulary (tensor_parallel.VocabParallelHead) holds a slice of the
        # rows the screen would pick among: it is never screened
        screens = settings.screened_head and not isinstance(self.lm_head, VocabParallelHead)
        self.screened_head = ScreenedHead.of(self.lm_head, settings) if screens else None
        return count

    def tie_weights(self) -> None:
        if not self.config.tie_word_embeddings:
            return
        if isinstance(self.lm_head, VocabParallelHead):
            self.lm_head.tie(self.model.embed_tokens.weight)  # this rank's rows of the embedding
        else:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64 absolute positions
        cache: AttentionCache,
        tree_mask: torch.Tensor | None = None,  # [T, T] bool, node i may see node j; None = causal
        keep_queries: bool = False,
    ) -> ForwardOutput:
        return self.decode(tokens, positions, cache, tree_mask, keep_queries)

    @torch.inference_mode()
    def forward_batch(self, segments: Sequence[Segment]) -> list[ForwardOutput]:
        """Several requests' forwards (`Segment`), queries kept. On a float32 CPU engine the segments
        that the compiled decoder takes run as one call of it: every product over all their rows at
        once, attention per segment; a row's bits are those of the segment's own forward (the products
        and every per-row step are batch-invariant, attention sees the segment alone). The other
        segments run as one pass of the layers with `batched_forward` (`_batched_decode`), else one
        forward each."""
        outputs: list[ForwardOutput | None] = [None] * len(segments)
        joint: list[tuple[int, tuple[torch.Tensor, int]]] = []  # (segment, its attention input and mode)
        rest: list[int] = []
        compiled = self.cpu_decoder is not None and self.cpu_decoder.ready()
        for index, segment in enumerate(segments):
            count = segment.tokens.shape[0]
            takes = compiled and CpuDecoder.fits(count, segment.cache)
            attention = self._compiled_mask(count, segment) if takes else None
            if attention is not None:
                joint.append((index, attention))
            else:
                rest.append(index)
        if joint:
            chosen = [segments[index] for index, _ in joint]
            for (index, _), output in zip(
                joint, self._compiled_batch(chosen, [a for _, a in joint]), strict=True
            ):
                outputs[index] = output
        if self.batched_forward and len(rest) > 1:
            for index, output in zip(rest, self._batched_decode([segments[i] for i in rest]), strict=True):
                outputs[index] = output
        else:
            for index in rest:
                s = segments[index]
                outputs[index] = self.decode(s.tokens, s.positions, s.cache, s.tree_mask, keep_queries=True)
        return outputs  # type: ignore[return-value]

    def _batched_decode(self, segments: Sequence[Segment]) -> list[ForwardOutput]:
        """The segments through one pass of the layers: every product and norm over all their rows at
        once, attention per segment on its own cache with the kernel its own forward takes. A row's bits
        are its own forward's where the products are batch-invariant (`use_batch_invariant`; the CPU
        tiled products); elsewhere (cuBLAS, oneDNN) a product can sum a row in another order for
        another number of rows, so in bf16 a near tie can go the other way."""
        counts = [s.tokens.shape[0] for s in segments]
        x = self.model.embed_tokens(torch.cat([s.tokens for s in segments]))  # [T, hidden]
        cos, sin = self.rotary.cos_sin(torch.cat([s.positions for s in segments]), x.dtype)
        masks = [self._decode_mask(n, s.cache, s.tree_mask, None, x) for n, s in zip(counts, segments)]
        caches = [s.cache for s in segments]
        queries: list[list[torch.Tensor]] = []  # per layer, per segment [T_s, heads, head_dim]

        def attend(attention: Attention, h: torch.Tensor, layer: int) -> torch.Tensor:
            attended, q = attention.forward_segments(h, cos, sin, counts, masks, caches, layer)
            queries.append(q)
            return attended

        hidden = self._layers(x, attend).split(counts)
        return [
            ForwardOutput(hidden=h, queries=[per_layer[index] for per_layer in queries])
            for index, h in enumerate(hidden)
        ]

    def _compiled_mask(self, count: int, segment: Segment) -> tuple[torch.Tensor, int] | None:
        """(attention input, mode) of the compiled decoder for a segment, as `decode` passes them; None
        where `decode` would not take the compiled decoder."""
        mask = self._attention_mask(count, segment.cache, segment.tree_mask, None, segment.tokens.device)
        c = self.config
        if mask.kernel == "cpu_tree_attention":
            return mask.mask, 2
        if mask.kernel != "sdpa":
            return None
        bias = sdpa_bias(mask.mask, c.num_heads, c.num_kv_heads, self.model.embed_tokens.weight.dtype)
        return bias, 0 if folds_groups(c.num_heads, c.num_kv_heads, count) else 1

    def _compiled_batch(
        self, segments: Sequence[Segment], attention: Sequence[tuple[torch.Tensor, int]]
    ) -> list[ForwardOutput]:
        """Segments the compiled decoder takes, in one call of it (`CpuDecoder.run_batch`)."""
        assert self.cpu_decoder is not None
        tokens = torch.cat([s.tokens for s in segments])
        positions = torch.cat([s.positions for s in segments])
        x = self.model.embed_tokens(tokens)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        counts = [s.tokens.shape[0] for s in segments]
        hidden, queries = self.cpu_decoder.run_batch(
            x,
            cos,
            sin,
            [s.cache for s in segments],  # type: ignore[misc]
            counts,
            [mask for mask, _ in attention],
            [mode for _, mode in attention],
            kernels.default_scale(self.config.head_dim),
        )
        outputs, start = [], 0
        for count in counts:
            end = start + count
            outputs.append(ForwardOutput(hidden=hidden[start:end], queries=[q[start:end] for q in queries]))
            start = end
        return outputs

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None = None,
        keep_queries: bool = False,
        static: StaticAttention | None = None,
    ) -> ForwardOutput:
        """`forward` without the inference-mode wrapper (for export and training).

        `static`, when given, replaces the mask built from the cache's prefix and `tree_mask`: the
        fixed-shape forward (static_step.py) attends over the whole capacity.
        """
        x = self.model.embed_tokens(tokens)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        mask = self._decode_mask(tokens.shape[0], cache, tree_mask, static, x)
        compiled = self.cpu_decoder is not None and mask.kernel in ("sdpa", "cpu_tree_attention")
        if compiled and static is None and self.cpu_decoder.usable(tokens.shape[0], cache):
            return self._compiled_decode(x, cos, sin, mask, cache, keep_queries)
        queries: list[torch.Tensor] = []

        def attend(attention: Attention, h: torch.Tensor, layer: int) -> torch.Tensor:
            attended, q = attention(h, cos, sin, mask, cache, layer)
            queries.append(q)
            return attended

        hidden = self._layers(x, attend)
        return ForwardOutput(hidden=hidden, queries=queries if keep_queries else None)

    def _layers(
        self, x: torch.Tensor, attend: Callable[[Attention, torch.Tensor, int], torch.Tensor]
    ) -> torch.Tensor:
        """x [T, hidden] through every layer, `attend(layer's attention, normed x, layer index)` giving
        the attention output; -> hidden [T, hidden] before the final norm. With `fused_elementwise`, each
        residual add and the RMSNorm after it are one op (`kernels.add_rms_norm`, one kernel on CUDA):
        the same function, two ops per layer instead of ~18."""
        layers = self.model.layers
        if not self.fused_elementwise:
            for index, layer in enumerate(layers):
                x = x + attend(layer.self_attn, layer.input_layernorm(x), index)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return x
        first = layers[0].input_layernorm
        _, h = kernels.add_rms_norm(x, None, first.weight, first.eps)
        for index, layer in enumerate(layers):
            norm = layer.post_attention_layernorm
            x, h = kernels.add_rms_norm(x, attend(layer.self_attn, h, index), norm.weight, norm.eps)
            out = layer.mlp(h)
            if index + 1 < len(layers):
                norm = layers[index + 1].input_layernorm
                x, h = kernels.add_rms_norm(x, out, norm.weight, norm.eps)
            else:
                x = x + out  # the final norm is the LM head's and the draft layers' business
        return x

    def _compiled_decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: AttentionCache,
        keep_queries: bool,
    ) -> ForwardOutput:
        """`decode`'s layers in one call of the compiled CPU decoder (cpu_decoder.py)."""
        assert self.cpu_decoder is not None and isinstance(cache, KVCache)
        c = self.config
        if mask.kernel == "cpu_tree_attention":
            attention, mode = mask.mask, 2
        else:
            assert mask.kernel == "sdpa" and mask.bias is not None
            attention, mode = mask.bias, 0 if folds_groups(c.num_heads, c.num_kv_heads, x.shape[0]) else 1
        hidden, queries = self.cpu_decoder.run(
            x, cos, sin, cache, attention, mode, kernels.default_scale(c.head_dim), keep_queries
        )
        return ForwardOutput(hidden=hidden, queries=queries)  # queries: per layer [T, heads, head_dim]

    @staticmethod
    def _device_tree(
        count: int,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None,
        static: StaticAttention | None,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's tree mask [T, T] bool, the committed length 0-d int64), both on the device: a
        fixed-shape step's own (one graph for every context), else from the cache and the mask (causal
        when None)."""
        if static is not None:
            return static.tree_mask, static.prefix_length
        causal = torch.ones(count, count, dtype=torch.bool, device=device).tril()
        tree = causal if tree_mask is None else tree_mask.to(device)
        return tree, torch.full((), cache.prefix_length, dtype=torch.int64, device=device)

    def _flash_cascade_mask(
        self,
        count: int,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None,
        static: StaticAttention | None,
        device: torch.device,
    ) -> AttentionMask:
        c = self.config
        tree, prefix = self._device_tree(count, cache, tree_mask, static, device)
        capacity = static.full_mask.shape[1] if static is not None else cache.prefix_length + count
        cuda = device.type == "cuda"  # elsewhere (tests) one range: the CPU path runs range by range
        processors = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        group_rows = count * (c.num_heads // c.num_kv_heads)
        splits = cascade.flash_splits(group_rows, c.num_kv_heads, capacity, processors)
        return AttentionMask(
            "flash_cascade",
            tree,
            prefix,
            splits=splits,
            fused_tail=self.cascade_fused_tail,
            prefix_backend=self.cascade_prefix,
        )

    def _aligned_mask(
        self,
        count: int,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None,
        static: StaticAttention | None,
        device: torch.device,
    ) -> AttentionMask:
        from tokenswift_trt.kernels.triton_aligned import (
            tree_depths_and_ancestors,  # Triton: CUDA builds of PyTorch only
        )

        tree, prefix = self._device_tree(count, cache, tree_mask, static, device)
        depths, ancestors = tree_depths_and_ancestors(tree, prefix)  # once per forward, every layer reads
        return AttentionMask("aligned", tree, prefix, depths=depths, ancestors=ancestors)

    def _decode_mask(
        self,
        count: int,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None,
        static: StaticAttention | None,
        x: torch.Tensor,  # [T, hidden]: the forward's device and dtype
    ) -> AttentionMask:
        """`_attention_mask` with SDPA's additive bias built once for the forward."""
        mask = self._attention_mask(count, cache, tree_mask, static, x.device)
        if mask.kernel == "sdpa":
            mask.bias = sdpa_bias(mask.mask, self.config.num_heads, self.config.num_kv_heads, x.dtype)
        return mask

    def _attention_mask(
        self,
        count: int,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None,
        static: StaticAttention | None,
        device: torch.device,
    ) -> AttentionMask:
        # position-aligned attention for steps whose nodes are all shallower than 64 levels, as known
        # here: said by a fixed-shape caller, counted in a host mask, a causal chunk of <= 64 tokens
        if self.aligned_attention and count <= kernels.MAX_TREE_TOKENS:
            if static is not None:
                shallow = static.aligned
            elif tree_mask is None:
                shallow = count <= ALIGNED_MAX_LEVELS
            else:
                shallow = tree_mask.device.type == "cpu" and aligned_fits(tree_mask)
            if shallow:
                return self._aligned_mask(count, cache, tree_mask, static, device)
        # the kernel is for trees (T <= 256); long prefill chunks take SDPA
        kernel = self.attention_kernel
        if kernel == "flash_cascade" and count <= kernels.MAX_TREE_TOKENS:
            if static is not None and static.cascade is not None:  # the caller's route
                cascade = static.cascade
            else:
                capacity = static.full_mask.shape[1] if static is not None else cache.prefix_length + count
                cascade = count * capacity >= self.cascade_min_work
            if cascade:
                return self._flash_cascade_mask(count, cache, tree_mask, static, device)
            kernel = self.cascade_fallback
        use_kernel = kernel == "tree_attention" and count <= kernels.MAX_TREE_TOKENS
        if static is not None:
            if use_kernel:
                return AttentionMask(
                    "tree_attention_static",
                    kernels.pack_tree_mask(static.tree_mask),
                    static.prefix_length.to(torch.int32),
                )
            return AttentionMask("sdpa", static.full_mask)
        # the CPU kernel for 1..256 tokens; no static form
        cpu_kernel = (
            self.attention_kernel == "cpu_tree_attention"
            and CPU_KERNEL_MIN_TOKENS <= count <= kernels.MAX_TREE_TOKENS
        )
        if cpu_kernel:
            return AttentionMask(self.attention_kernel, self._packed_host_mask(count, tree_mask))
        if use_kernel:
            causal = torch.ones(count, count, dtype=torch.bool, device=device).tril()
            return AttentionMask(
                "tree_attention",
                kernels.pack_tree_mask(causal if tree_mask is None else tree_mask.to(device)),
            )
        return AttentionMask("sdpa", attention_mask(cache.prefix_length, tree_mask, count, device))

    def _packed_host_mask(self, count: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
        """`pack_tree_mask` of a CPU mask (causal when None), memoised by its bits: a static tree
        verifies the same mask every iteration, so it is packed once."""
        mask = torch.ones(count, count, dtype=torch.bool).tril() if tree_mask is None else tree_mask.cpu()
        key = (count, mask.numpy().tobytes())
        packed = self._packed_masks.get(key)
        if packed is None:
            if len(self._packed_masks) >= PACKED_MASK_MEMO:
                self._packed_masks.clear()
            packed = self._packed_masks[key] = kernels.pack_tree_mask(mask)
        return packed

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] (pre-norm) -> logits [..., vocab]."""
        return self.lm_head(self.model.norm(hidden))

    @torch.inference_mode()
    def target_logits(
        self, hidden: torch.Tensor, sampling: SamplingConfig, windows: torch.Tensor | None
    ) -> torch.Tensor:
        """`logits` of hidden [R, hidden] for `sampling` to draw from, windows [W] or [R, W] its penalty's
        ids: on a CPU the float16-screened head where it applies (screened_head.py: the float32 logits of
        every token sampling could keep, a score below anything real elsewhere), else, and without
        `windows`, the full head."""
        normed = self.model.norm(hidden)
        head = self.screened_head
        if windows is not None and head is not None and normed.dim() == 2:
            if head.applies(len(normed), sampling):
                return head.logits(normed, sampling, windows)
        return self.lm_head(normed)

    @torch.inference_mode()
    def draft(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: AttentionCache, draft_layers: nn.Module
    ) -> torch.Tensor:
        """The draft pass: tokens [1] on `cache` -> logits of every head for the last token [1 + n, vocab]."""
        hidden = self.decode(tokens, positions, cache).hidden
        return self.head_logits(hidden[-1:], draft_layers)[:, 0]

    def head_logits(
        self,
        hidden: torch.Tensor,
        draft_layers: nn.Module,
        depth: int | None = None,
        choose_root: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden [T, hidden] (pre-norm) -> logits of the base head and each draft layer [1 + n, T, vocab]
        (n = `depth` when given: only the first `depth` draft layers). Root-conditioned layers are
        conditioned on `choose_root(base logits [T, V])` -> [T] token ids (the draft the base head's row
        will offer first: with the target's noise known, its sample), else on the most likely token."""
        if reads_root(draft_layers) or vocab_head(draft_layers) is not None:
            base = self.lm_head(self.model.norm(hidden))  # [T, V]
            depth = len(draft_layers) if depth is None else depth
            roots = base.argmax(dim=-1) if choose_root is None else choose_root(base)
            drafts = self.draft_logits(hidden, draft_layers, depth, roots)  # [n, T, V]
            return torch.cat((base[None], drafts))
        states = torch.stack(
            [self.model.norm(hidden)] + list(draft_layers(hidden, depth))
        )  # [1 + n, T, hidden]
        return self.lm_head(states)  # one pass over the head's weights for all heads

    @torch.inference_mode()
    def draft_logits(
        self, hidden: torch.Tensor, draft_layers: nn.Module, depth: int, roots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, hidden] (pre-norm) -> logits of the first `depth` draft layers only [depth, T, vocab]
        (drafting from the verify pass: the base head's row is the verify pass's own, and a tree
        `depth` deep reads no deeper layer). `roots` [T]: the token after each row's own, which
        root-conditioned layers read (and require)."""
        embedding = None
        if reads_root(draft_layers) and roots is not None:
            embedding = self.model.embed_tokens(roots)  # [T, hidden]
        states = torch.stack(draft_layers(hidden, depth, embedding))  # [depth, T, hidden]
        head = vocab_head(draft_layers)
        return self.lm_head(states) if head is None else head(states)

    @torch.inference_mode()
    def path_logits(
        self, states: torch.Tensor, draft_layers: nn.Module, tokens: torch.Tensor, first: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One level of drafting along tree paths (draft layers with a path input,
        `draft_layers.PathInput`). `first`: states [T, hidden] are the verify pass's (pre-norm) and
        tokens [T] the roots after them, and layer 1 drafts; else states are the level before's and
        tokens the drafts made from them, and the path input drafts the next. -> (the states this
        level drafted from [T, hidden], the next level's input; logits [T, vocab])."""
        if first:
            state, normed = draft_layers.chain(states, 1, self.model.embed_tokens(tokens))[0]
        else:
            state, normed = draft_layers.path(states, self.model.embed_tokens(tokens))
        head = vocab_head(draft_layers)
        return state, self.lm_head(normed) if head is None else head(normed)
