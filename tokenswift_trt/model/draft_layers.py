"""TokenSwift's three chained draft layers, optionally conditioned on the root token.

Layer i maps the previous hidden state h_{i-1} (h_0 = the target's last-layer output, before the
final norm) to h_i = h_{i-1} + W_i · rmsnorm_a_i(h_{i-1}); its prediction is
lm_head(rmsnorm_b_i(h_i)), the token i+1 positions after the next one. Layers are chained, not
independent heads.

Root conditioning (beyond the paper): h_0 is the state of token t, and the token after it,
x[t+1], is usually known when drafting starts (drafting from the verify pass it is the root, the
target's own sample), but the paper's layers never see it, so under sampling layer 1 must guess
x[t+2] without knowing which x[t+1] was drawn. With `root_conditioned`, the chain starts from
h_0 + U · rmsnorm_r(embed(x[t+1])) instead (one more hidden × hidden linear, zero-initialised so a
new U repeats the unconditioned layers). Where x[t+1] is not known (the paper's partial-cache
draft pass, whose base head drafts it), the base head's most likely token stands in.
A wider root input (`root_width` > 0) reads both: h_0 + D · silu(U · [rmsnorm_h(h_0);
rmsnorm_r(embed(x[t+1]))]), U [width, 2 · hidden], D [hidden, width] zero-initialised. On
SmolLM2-135M (width 2,304) it lifts layer 1's chance of drafting the target's sample (docs/smollm2.md).

Path input (beyond the paper; `path_width` > 0, root-conditioned layers only): the chained layers
2 and 3 never see the token drafted before theirs, so every depth-2 branch of a tree gets the same
candidates whichever depth-1 token it follows. A path input drafts depth d >= 2 from depth d-1's
state s (before its norm) and the token t drafted there: s' = s + M(s, embed(t)), s'' = s' + W ·
rmsnorm_a(s'), prediction lm_head(rmsnorm_b(s'')), with M a `RootMLP` of that width. One module
serves every depth (s'' is the next depth's s), so a tree drafts one pass per level, one row per
branch. On SmolLM2-135M it doubles the chance that a depth-2 draft holds the target's sample
(docs/smollm2.md). Where a tree is drafted per depth (partial-cache drafting, the device loop) the
chained layers 2 and 3 are used as before.

Draft vocabulary (beyond the paper): a heads file may carry `vocab` [K] int64, the K tokens most
frequent in the layers' training text. The draft layers' logits then come from those K rows of
the LM head only (the other tokens get -inf): on SmolLM2-135M the head is 49,152 x 576, a fifth of
the model's weights, read once more per iteration when drafting needs its own head pass, and the
16,384 most frequent tokens of the training books cover ~97% of a held-out book's tokens.
Verification always uses the whole vocabulary, so output is unchanged; only acceptance can drop,
by the accepted drafts that were rare tokens.

4-bit weights (heads files only): a large weight may be stored as `NAME.q4` (uint8 [out, in / 2],
two signed 4-bit values per byte, low nibble first) with `NAME.q4_scales` (float16 [out, in /
group]): w = q * scale within each group of `group` inputs (32 by default; the shapes say
which). `read_heads_file` turns them back into
`NAME` (float32), so every reader sees plain weights; `quantized_q4` writes them. A draft layer's
weights only change what is drafted, never what is accepted, so rounding costs acceptance at most.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.decoder import RMSNorm
from tokenswift_trt.model.linear import TILED_MAX_ROWS, Linear

# Key names of the released TokenSwift checkpoints (weights inside the base checkpoint).
RELEASED_PREFIX = "model.medusa_layers."
# Our own heads-file prefix.
HEADS_PREFIX = "draft_layers."
# State-dict prefix of the root-token input (heads files: HEADS_PREFIX + ROOT_PREFIX + ...).
ROOT_PREFIX = "root."
# State-dict prefix of the path input (heads files: HEADS_PREFIX + PATH_PREFIX + ...).
PATH_PREFIX = "path."
# State-dict key of the draft vocabulary (heads files: HEADS_PREFIX + VOCAB_KEY), int64 token ids.
VOCAB_KEY = "vocab"


class DraftLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=False)
        self.input_layernorm = RMSNorm(hidden_size, eps)  # a_i
        self.post_layernorm = RMSNorm(hidden_size, eps)  # b_i

    def step(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> (h + W · rmsnorm_a(h), its normalised form rmsnorm_b(...) for lm_head)."""
        state = state + self.linear(self.input_layernorm(state))
        return state, self.post_layernorm(state)

    def reset_(self) -> None:
        """Untrained: W = 0 (adds nothing), unit norms."""
        self.linear.weight.zero_()
        self.input_layernorm.weight.fill_(1.0)
        self.post_layernorm.weight.fill_(1.0)


class RootInput(nn.Module):
    """U · rmsnorm_r(embedding of the root token), added to h_0."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=False)  # U
        self.norm = RMSNorm(hidden_size, eps)  # r

    def forward(self, hidden: torch.Tensor, root_embedding: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(root_embedding))  # [T, hidden]

    def reset_(self) -> None:
        """Untrained: U = 0, unit norm (adds nothing)."""
        self.linear.weight.zero_()
        self.norm.weight.fill_(1.0)


class RootMLP(nn.Module):
    """D · silu(U · [rmsnorm_h(h_0); rmsnorm_r(embedding of the root)]), added to h_0."""

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(hidden_size, eps)  # h
        self.norm = RMSNorm(hidden_size, eps)  # r
        self.up = Linear(2 * hidden_size, width, bias=False)  # U
        self.down = Linear(width, hidden_size, bias=False)  # D

    def forward(self, hidden: torch.Tensor, root_embedding: torch.Tensor) -> torch.Tensor:
        both = torch.cat((self.hidden_norm(hidden), self.norm(root_embedding)), dim=-1)  # [T, 2 · hidden]
        return self.down(nn.functional.silu(self.up(both)))  # [T, hidden]

    def reset_(self) -> None:
        """Untrained: D = 0 (adds nothing), U random so that D can learn, unit norms."""
        nn.init.normal_(self.up.weight, std=self.up.weight.shape[1] ** -0.5)
        self.down.weight.zero_()
        self.hidden_norm.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)


class PathInput(nn.Module):
    """Depth d >= 2 from depth d-1's state and drafted token (see the module docstring)."""

    def __init__(self, hidden_size: int, width: int, eps: float) -> None:
        super().__init__()
        self.input = RootMLP(hidden_size, width, eps)  # M
        self.layer = DraftLayer(hidden_size, eps)  # W, a, b

    def forward(
        self, state: torch.Tensor, token_embedding: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """state [T, hidden] (pre-norm), token_embedding [T, hidden] -> (the next state [T, hidden],
        pre-norm: the next depth's input; its normalised form [T, hidden], for lm_head)."""
        fused = compiled_chain(self.input, [self.layer], state, token_embedding)
        if fused is not None:
            return fused[0]
        return self.layer.step(state + self.input(state, token_embedding))


@dataclass
class VocabHead:
    """The LM head's rows of the draft vocabulary: states [..., hidden] -> logits [..., V], -inf
    outside the vocabulary. Not a module: built from the model's head at load time, never saved.
    Under a head split over the vocabulary (tensor_parallel.VocabParallelHead) each rank holds the
    vocabulary's rows within its slice (zero rows up to the widest rank's count) and one all-gather
    brings every rank's logits together (`columns`: where the vocabulary's ids sit in them)."""

    ids: torch.Tensor  # [K] int64, ascending
    linear: Linear  # [K, hidden]: those rows of the LM head (packed for the CPU); [K', hidden] split
    vocab_size: int
    tp: object | None = None  # tensor_parallel.TensorParallel of a split head
    columns: torch.Tensor | None = None  # [K] int64: the ids' columns in the gathered [..., size * K']

    @classmethod
    def of(cls, ids: torch.Tensor, head_weight: torch.Tensor, tp=None, vocab_size: int = 0) -> VocabHead:
        """`tp`, `vocab_size`: a head split over the vocabulary, head_weight [ceil(V / size), hidden]
        this rank's rows of it."""
        ids = ids.to(head_weight.device)
        columns = None
        with torch.no_grad():
            if tp is None:
                rows = head_weight.detach().index_select(0, ids)
            else:
                width = head_weight.shape[0]  # the head's rows per rank
                owner = torch.div(ids, width, rounding_mode="floor")  # [K]: the rank holding each id
                counts = torch.bincount(owner, minlength=tp.size)
                most = int(counts.max())
                mine = ids[owner == tp.rank] - tp.rank * width
                rows = head_weight.detach().new_zeros(most, head_weight.shape[1])
                rows[: len(mine)] = head_weight.detach().index_select(0, mine)
                starts = torch.cumsum(counts, 0) - counts  # [size]: each rank's first id
                columns = owner * most + torch.arange(len(ids), device=ids.device) - starts[owner]
        linear = Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        linear.weight = nn.Parameter(rows, requires_grad=False)
        linear.pack(half=True)  # float16 where the tiled kernel applies: it only drafts
        return cls(ids, linear, vocab_size or head_weight.shape[0], tp, columns)

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        part = self.linear(states)  # [..., K] ([..., K'] on each rank of a split head)
        if self.tp is not None:
            part = self.tp.gather_last(part).index_select(-1, self.columns)  # [..., K]
        full = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, part)


class DraftLayers(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        num_layers: int = 3,
        root_conditioned: bool = False,
        vocab_size: int = 0,
        root_width: int = 0,
        path_width: int = 0,
    ) -> None:
        """`vocab_size` > 0: the layers carry a draft vocabulary of that many ids (`vocab`);
        `root_width` > 0 (root-conditioned layers only): the root input is a `RootMLP` that wide;
        `path_width` > 0 (root-conditioned layers only): a `PathInput` that wide drafts depths >= 2."""
        super().__init__()
        if root_width and not root_conditioned:
            raise ValueError("a root input width needs root-conditioned draft layers")
        if path_width and not root_conditioned:
            raise ValueError("a path input needs root-conditioned draft layers")
        self.layers = nn.ModuleList(
            DraftLayer(config.hidden_size, config.rms_norm_eps) for _ in range(num_layers)
        )
        self.root: RootInput | RootMLP | None = None
        if root_width:
            self.root = RootMLP(config.hidden_size, root_width, config.rms_norm_eps)
        elif root_conditioned:
            self.root = RootInput(config.hidden_size, config.rms_norm_eps)
        self.path: PathInput | None = None
        if path_width:
            self.path = PathInput(config.hidden_size, path_width, config.rms_norm_eps)
        self.vocab: torch.Tensor | None  # [K] int64 token ids, ascending; None = the whole vocabulary
        self.register_buffer(VOCAB_KEY, torch.arange(vocab_size) if vocab_size else None)
        self.vocab_head: VocabHead | None = None  # `use_vocab_head`, for inference

    def use_vocab_head(self, head_weight: torch.Tensor, tp=None, vocab_size: int = 0) -> bool:
        """Draft through the LM head's rows of the vocabulary (`VocabHead`; `tp`, `vocab_size`: a head
        split over the vocabulary, of which head_weight holds this rank's rows); False where the layers
        have no vocabulary. Call again after the head's weight changes."""
        if self.vocab is None:
            self.vocab_head = None
        else:
            self.vocab_head = VocabHead.of(self.vocab, head_weight, tp, vocab_size)
        return self.vocab_head is not None

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def root_conditioned(self) -> bool:
        return self.root is not None

    @property
    def root_width(self) -> int:
        """The `RootMLP`'s width, 0 for a linear root input or none."""
        return self.root.up.weight.shape[0] if isinstance(self.root, RootMLP) else 0

    @property
    def path_width(self) -> int:
        """The `PathInput`'s width, 0 for none."""
        return 0 if self.path is None else self.path.input.up.weight.shape[0]

    def zero_(self) -> DraftLayers:
        """Untrained state: W = U = 0 (a `RootMLP`: D = 0, U random so that D can learn) and unit
        norms, so every layer repeats the base prediction."""
        with torch.no_grad():
            for layer in self.layers:
                layer.reset_()
            if self.root is not None:
                self.root.reset_()
            if self.path is not None:  # adds nothing: depth d repeats layer 1's state's prediction
                self.path.input.reset_()
                self.path.layer.reset_()
        return self

    def forward(
        self, hidden: torch.Tensor, count: int | None = None, root_embedding: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """hidden [T, hidden] (pre-norm) -> per layer the normalised state [T, hidden] for lm_head;
        `count` stops after the first `count` layers (a shallow tree needs no deeper drafts);
        `root_embedding` [T, hidden]: the input embedding of the token after each row's own (used,
        and required, by root-conditioned layers)."""
        return [norm for _, norm in self.chain(hidden, count, root_embedding)]

    def chain(
        self, hidden: torch.Tensor, count: int | None = None, root_embedding: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`forward`, with each layer's state before its norm: per layer (state, normalised state),
        both [T, hidden] (a path input continues from layer 1's state)."""
        if self.root is not None and root_embedding is None:
            raise ValueError("root-conditioned draft layers need the root token's embedding")
        fused = compiled_chain(self.root, list(itertools.islice(self.layers, count)), hidden, root_embedding)
        if fused is not None:
            return fused
        if self.root is not None:
            hidden = hidden + self.root(hidden, root_embedding)
        outputs = []
        for layer in itertools.islice(
            self.layers, count
        ):  # not self.layers[:count]: slicing builds a ModuleList
            hidden, normed = layer.step(hidden)
            outputs.append((hidden, normed))
        return outputs


def compiled_chain(
    root: RootInput | RootMLP | None,
    layers: list[DraftLayer],
    hidden: torch.Tensor,
    root_embedding: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """hidden + root(hidden, root_embedding), then `layers`, in one call of the compiled CPU kernels
    (decoder_cpu.cpp's draft_chain): per layer (state, normalised state), each [T, hidden], as
    `DraftLayer.step` gives them. A draft pass of one row is ~15 PyTorch operations around its
    products (norms, concatenation, SiLU, adds), each a Python call and an ATen dispatch, which cost
    more than the products themselves on a CPU. None where it does not apply (not CPU inference in
    float32, more rows than the tiled kernel takes, a product not packed in its layout): the PyTorch
    modules then run."""
    if (
        not layers
        or not torch.is_inference_mode_enabled()
        or torch.compiler.is_compiling()
        or hidden.device.type != "cpu"
        or hidden.dtype != torch.float32
        or hidden.dim() != 2
        or hidden.shape[0] > TILED_MAX_ROWS
    ):
        return None
    if isinstance(root, RootMLP):
        root_products, root_norms = [root.up, root.down], [root.hidden_norm.weight, root.norm.weight]
    elif isinstance(root, RootInput):
        root_products, root_norms = [root.linear], [root.norm.weight]
    else:
        root_products, root_norms = [], []
    products = root_products + [layer.linear for layer in layers]
    if not all(product.packed and product._packed.kind == "tiled" for product in products):
        return None
    root_tensors = root_norms + [product._packed.data for product in root_products]
    layer_tensors = [
        tensor
        for layer in layers
        for tensor in (layer.input_layernorm.weight, layer.linear._packed.data, layer.post_layernorm.weight)
    ]
    embedding = hidden.new_empty(0) if root is None else root_embedding.contiguous()
    kernels = products[0]._packed.kernels
    out = kernels.draft_chain(  # type: ignore[union-attr]
        hidden.contiguous(), embedding, root_tensors, layer_tensors, layers[0].input_layernorm.eps
    )  # [2, count, T, hidden]
    return [(out[0, index], out[1, index]) for index in range(len(layers))]


def draft_key(key: str) -> str | None:
    """Map a checkpoint key to a `DraftLayers` state-dict key, or None when it is not a draft weight."""
    for prefix in (RELEASED_PREFIX, HEADS_PREFIX, "medusa_layers."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            own = rest.startswith((ROOT_PREFIX, PATH_PREFIX)) or rest == VOCAB_KEY
            return rest if own else "layers." + rest
    return None


def heads_file_key(state_key: str) -> str:
    """A `DraftLayers` state-dict key -> its name in a heads file (the inverse of `draft_key`)."""
    return HEADS_PREFIX + state_key.removeprefix("layers.")


@dataclass(frozen=True)
class DraftLayout:
    """What a `DraftLayers` state dict (`draft_key`'s names) holds: its constructor's arguments."""

    num_layers: int
    root_conditioned: bool
    vocab_size: int  # 0: no draft vocabulary
    root_width: int = 0  # a RootMLP's width; 0: a linear root input or none
    path_width: int = 0  # a PathInput's width; 0: none


def draft_layout(state: dict[str, torch.Tensor]) -> DraftLayout:
    layers = {key.split(".")[1] for key in state if key.startswith("layers.")}
    vocab = state.get(VOCAB_KEY)
    up = state.get(ROOT_PREFIX + "up.weight")
    path_up = state.get(PATH_PREFIX + "input.up.weight")
    return DraftLayout(
        len(layers),
        any(key.startswith(ROOT_PREFIX) for key in state),
        0 if vocab is None else vocab.numel(),
        0 if up is None else up.shape[0],
        0 if path_up is None else path_up.shape[0],
    )


Q4_SUFFIX, Q4_SCALES_SUFFIX = ".q4", ".q4_scales"
Q4_GROUP = 32  # inputs per scale


def quantized_q4(
    tensors: dict[str, torch.Tensor], min_numel: int = 1 << 20, group: int = Q4_GROUP
) -> dict[str, torch.Tensor]:
    """A heads file's tensors with every 2-D float weight of at least `min_numel` elements in 4 bits
    (symmetric, one float16 scale per `group` inputs of a row); the rest unchanged. Readers take
    the group from the shapes (inputs / scale columns)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        rows, columns = value.shape if value.dim() == 2 else (0, 0)
        if not value.is_floating_point() or value.numel() < min_numel or columns % group:
            out[key] = value
            continue
        groups = value.float().reshape(rows, columns // group, group)
        scales = (groups.abs().amax(-1) / 7).clamp_min(1e-12).half()  # [rows, groups]
        q = (groups / scales.float()[..., None]).round().clamp(-8, 7).to(torch.int16) + 8  # 0..15
        q = q.reshape(rows, columns).to(torch.uint8)
        out[key + Q4_SUFFIX] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [rows, columns / 2]
        out[key + Q4_SCALES_SUFFIX] = scales.contiguous()
    return out


def dequantized_q4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in / 2], scales float16 [out, in / group] -> float32 [out, in] (the group
    follows from the two shapes)."""
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).float() - 8
    return (q.reshape(*scales.shape, -1) * scales.float()[..., None]).reshape(q.shape)


def read_heads_file(path: Path) -> dict[str, torch.Tensor]:
    """A heads file's tensors by their file names, 4-bit weights restored to float32 and integer
    tensors (the draft vocabulary, which a file may store as int32) as int64."""
    tensors = {
        key: value if value.is_floating_point() or value.dtype == torch.uint8 else value.long()
        for key, value in load_file(str(path)).items()
    }
    for key in [k for k in tensors if k.endswith(Q4_SUFFIX)]:
        name = key.removesuffix(Q4_SUFFIX)
        scales = tensors.pop(name + Q4_SCALES_SUFFIX, None)
        if scales is None:
            raise ValueError(f"heads file {path}: {key} has no {name + Q4_SCALES_SUFFIX}")
        tensors[name] = dequantized_q4(tensors.pop(key), scales)
    return tensors
