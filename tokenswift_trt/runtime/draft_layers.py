"""TokenSwift's three chained draft layers.

Layer i maps the previous hidden state h_{i-1} (h_0 = the target's last-layer output, before the
final norm) to h_i = h_{i-1} + W_i · rmsnorm_a_i(h_{i-1}); its prediction is
lm_head(rmsnorm_b_i(h_i)), the token i+1 positions after the next one. Layers are chained, not
independent heads.
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


class DraftLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = Linear(hidden_size, hidden_size, bias=False)
        self.input_layernorm = RMSNorm(hidden_size, eps)  # a_i
        self.post_layernorm = RMSNorm(hidden_size, eps)  # b_i


class DraftLayers(nn.Module):
    def __init__(self, config: ModelConfig, num_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DraftLayer(config.hidden_size, config.rms_norm_eps) for _ in range(num_layers)
        )

    def __len__(self) -> int:
        return len(self.layers)

    def zero_(self) -> DraftLayers:
        """Untrained state: W = 0 and unit norms, so every layer repeats the base prediction."""
        with torch.no_grad():
            for layer in self.layers:
                layer.linear.weight.zero_()
                layer.input_layernorm.weight.fill_(1.0)
                layer.post_layernorm.weight.fill_(1.0)
        return self

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
        """hidden [T, hidden] (pre-norm) -> per layer the normalised state [T, hidden] for lm_head;
        `count` stops after the first `count` layers (a shallow tree needs no deeper drafts)."""
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
            return "layers." + key[len(prefix) :]
    return None
