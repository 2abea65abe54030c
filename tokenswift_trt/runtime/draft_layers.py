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
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .config import ModelConfig
from .cpu_linear import Linear
from .model import RMSNorm

# Key names of the released TokenSwift checkpoints (weights inside the base checkpoint).
RELEASED_PREFIX = "model.medusa_layers."
# Our own heads-file prefix.
HEADS_PREFIX = "draft_layers."
# State-dict prefix of the root-token input (heads files: HEADS_PREFIX + ROOT_PREFIX + ...).
ROOT_PREFIX = "root."


class DraftLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=False)
        self.input_layernorm = RMSNorm(hidden_size, eps)  # a_i
        self.post_layernorm = RMSNorm(hidden_size, eps)  # b_i


class RootInput(nn.Module):
    """U · rmsnorm_r(embedding of the root token), added to h_0."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=False)  # U
        self.norm = RMSNorm(hidden_size, eps)  # r


class DraftLayers(nn.Module):
    def __init__(self, config: ModelConfig, num_layers: int = 3, root_conditioned: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DraftLayer(config.hidden_size, config.rms_norm_eps) for _ in range(num_layers)
        )
        self.root = RootInput(config.hidden_size, config.rms_norm_eps) if root_conditioned else None

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def root_conditioned(self) -> bool:
        return self.root is not None

    def zero_(self) -> DraftLayers:
        """Untrained state: W = U = 0 and unit norms, so every layer repeats the base prediction."""
        with torch.no_grad():
            for layer in self.layers:
                layer.linear.weight.zero_()
                layer.input_layernorm.weight.fill_(1.0)
                layer.post_layernorm.weight.fill_(1.0)
            if self.root is not None:
                self.root.linear.weight.zero_()
                self.root.norm.weight.fill_(1.0)
        return self

    def forward(
        self, hidden: torch.Tensor, count: int | None = None, root_embedding: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """hidden [T, hidden] (pre-norm) -> per layer the normalised state [T, hidden] for lm_head;
        `count` stops after the first `count` layers (a shallow tree needs no deeper drafts);
        `root_embedding` [T, hidden]: the input embedding of the token after each row's own (used,
        and required, by root-conditioned layers)."""
        if self.root is not None:
            if root_embedding is None:
                raise ValueError("root-conditioned draft layers need the root token's embedding")
            hidden = hidden + self.root.linear(self.root.norm(root_embedding))
        outputs = []
        for layer in itertools.islice(
            self.layers, count
        ):  # not self.layers[:count]: slicing builds a ModuleList
            hidden = hidden + layer.linear(layer.input_layernorm(hidden))
            outputs.append(layer.post_layernorm(hidden))
        return outputs


def draft_key(key: str) -> str | None:
    """Map a checkpoint key to a `DraftLayers` state-dict key, or None when it is not a draft weight."""
    for prefix in (RELEASED_PREFIX, HEADS_PREFIX, "medusa_layers."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            return rest if rest.startswith(ROOT_PREFIX) else "layers." + rest
    return None


def heads_file_key(state_key: str) -> str:
    """A `DraftLayers` state-dict key -> its name in a heads file (the inverse of `draft_key`)."""
    return HEADS_PREFIX + state_key.removeprefix("layers.")


def draft_layout(state: dict[str, torch.Tensor]) -> tuple[int, bool]:
    """(number of layers, root-conditioned) of a `DraftLayers` state dict (`draft_key`'s names)."""
    layers = {key.split(".")[1] for key in state if key.startswith("layers.")}
    return len(layers), any(key.startswith(ROOT_PREFIX) for key in state)
