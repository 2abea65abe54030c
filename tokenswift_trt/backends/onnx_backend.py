"""Run the exported draft and verify graphs with onnxruntime, behind the model interface decoding uses.

The runtime keeps owning the caches: each call passes the cache's committed K/V as inputs and
writes the returned new K/V into the cache's pending slots, exactly where the torch forward
writes them. Norm, LM head and per-node logits reuse the torch modules' weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from tokenswift_trt.model.decoder import AttentionCache, ForwardOutput, GraphDecoder, LlamaModel


class OnnxBackendError(RuntimeError):
    """onnxruntime is missing or the graphs cannot be loaded."""


def _session(path: Path, providers: list[str] | None):
    try:
        import onnxruntime
    except ImportError:
        raise OnnxBackendError(
            "the onnx backend needs onnxruntime: pip install onnxruntime (or onnxruntime-gpu)"
        ) from None
    if not path.is_file():
        raise OnnxBackendError(f"missing ONNX graph {path}: rebuild the engine with --backend onnx")
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])


class OnnxDecoder(GraphDecoder):
    """Drop-in for `LlamaModel` in decoding: forward/draft run in onnxruntime, logits in torch."""

    def __init__(self, torch_model: LlamaModel, onnx_dir: Path, providers: list[str] | None = None) -> None:
        super().__init__(torch_model)
        self.verify_session = _session(onnx_dir / "verify.onnx", providers)
        self.draft_session = _session(onnx_dir / "draft.onnx", providers)

    @staticmethod
    def _kv_inputs(cache: AttentionCache) -> dict[str, np.ndarray]:
        keys, values = cache.committed_kv()  # type: ignore[attr-defined]
        return {
            "past_keys": np.ascontiguousarray(keys.cpu().numpy()),
            "past_values": np.ascontiguousarray(values.cpu().numpy()),
        }

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: AttentionCache,
        tree_mask: torch.Tensor | None = None,
        keep_queries: bool = False,
    ) -> ForwardOutput:
        count = tokens.shape[0]
        if tree_mask is None:
            tree_mask = torch.ones(count, count, dtype=torch.bool).tril()
        feeds = {
            "tokens": tokens.cpu().numpy(),
            "positions": positions.cpu().numpy(),
            "tree_mask": tree_mask.cpu().numpy(),
            **self._kv_inputs(cache),
        }
        hidden, new_keys, new_values, queries = self.verify_session.run(None, feeds)
        device = tokens.device
        self.write_back(cache, torch.from_numpy(new_keys).to(device), torch.from_numpy(new_values).to(device))
        query_list = [torch.from_numpy(q).to(device) for q in queries] if keep_queries else None
        return ForwardOutput(hidden=torch.from_numpy(hidden).to(device), queries=query_list)

    def draft(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: AttentionCache, draft_layers: nn.Module
    ) -> torch.Tensor:
        feeds = {
            "tokens": tokens.cpu().numpy(),
            "positions": positions.cpu().numpy(),
            **self._kv_inputs(cache),
        }
        head_logits, new_keys, new_values = self.draft_session.run(None, feeds)
        self.write_back(
            cache,
            torch.from_numpy(new_keys).to(tokens.device),
            torch.from_numpy(new_values).to(tokens.device),
        )
        return torch.from_numpy(head_logits[:, -1]).to(tokens.device)  # [1 + n, vocab]
