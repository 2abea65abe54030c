"""Tensor parallelism over a torch.distributed process group (docs/deploy.md, "Tensor parallelism").

Each rank holds a slice of every decoder layer: the Q/K/V and gate/up projections are split by
output rows (column-parallel: whole KV heads with their GQA groups of query heads, a slice of the
MLP's inner width), o_proj and down_proj by input columns (row-parallel), so a layer's attention
and MLP each end in one all-reduce of a [T, hidden] tensor (`RowParallelLinear`). The embedding,
the final norm and the draft layers are replicated. The LM head is either replicated too
(`head="replicated"`) or split over the vocabulary (`head="vocab"`, `VocabParallelHead`): rank r
holds rows [r * V', (r + 1) * V') of its weight (V' = ceil(V / N), the last slice padded with zero
rows; with tied embeddings a slice of the replicated embedding) and one all-gather assembles the
[.., V] logits. Either way every rank holds the same logits bits from the same all-reduced hidden
states, and samples, accepts and commits the same tokens with no further communication
(position-keyed noise, sampling.py).

A rank reads only its slices from the checkpoint (`read_shard`: safetensors slices, no full
tensor in memory), or, from an engine built with `build --tp N`, its own rank file
(`write_rank_files` / `read_rank_file`: the same slices, written once at build time).
`shard_config` is the per-rank shape (heads, KV heads and inner width / size): the rank's KV caches
and memory admission follow it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.linear import Linear

# parameter name suffix -> the dimension it is split along (0: output rows, 1: input columns)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
HEAD_KEY = "lm_head.weight"
# "replicated": every rank the whole LM head; "vocab": its slice of the vocabulary and an all-gather
HEAD_MODES = ("replicated", "vocab")
DEFAULT_HEAD = "replicated"


def default_head(backend: str) -> str:
    """The LM head's split where none is asked: over the vocabulary on GPUs (NCCL: modeled faster
    and 1/N of its memory), replicated on CPUs (gloo: measured faster, the float16-screened head
    applies); both in docs/bench/cpu-tp2-head; docs/deploy.md, "Tensor parallelism"."""
    return "vocab" if backend == "nccl" else "replicated"


DEFAULT_TIMEOUT_S = 120.0  # a collective waiting longer for a rank fails (a rank died or hangs)


class TensorParallelError(ValueError):
    """A tensor-parallel setup that cannot run (the message names the fix)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: its rank of `size`, the group (None: the
    default group of `torch.distributed.init_process_group`), and how the LM head is split
    (`HEAD_MODES`)."""

    rank: int
    size: int
    group: Any = None  # torch.distributed.ProcessGroup
    head: str = DEFAULT_HEAD

    def __post_init__(self) -> None:
        if self.head not in HEAD_MODES:
            raise TensorParallelError(
                f"the tensor-parallel LM head must be one of {', '.join(HEAD_MODES)}, got {self.head!r}"
            )

    @property
    def splits_vocab(self) -> bool:
        return self.head == "vocab" and self.size > 1

    def head_rows(self, vocab_size: int) -> int:
        """Rows of the LM head each rank holds under the vocabulary split: ceil(V / size)."""
        return -(-vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank receives the same bits: gloo and NCCL reduce
        each element once and send the result to all)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., W] on every rank -> [..., size * W]: the ranks' x side by side, in rank order."""
        every = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(every, x.contiguous(), group=self.group)
        return torch.cat(every, dim=-1)

    def gather(self, values: Sequence[int], device: torch.device | str = "cpu") -> list[list[int]]:
        """Every rank's `values` (the same count on each), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.group)
        return [item.tolist() for item in every]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` (a picklable object) on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` (picklable), in rank order."""
        every: list[Any] = [None] * self.size
        dist.all_gather_object(every, value, group=self.group)
        return every


def valid_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this model splits into: whole KV heads (with their query heads) and an
    equal share of the MLP's inner width on every rank."""
    return [
        size
        for size in range(1, config.num_kv_heads + 1)
        if config.num_kv_heads % size == 0 and config.intermediate_size % size == 0
    ]


def check_size(config: ModelConfig, size: int) -> None:
    """Raise TensorParallelError (one line, naming the valid sizes) unless `size` splits this model."""
    if size < 1:
        raise TensorParallelError(f"the tensor-parallel size must be at least 1, got {size}")
    sizes = valid_sizes(config)
    if size not in sizes:
        raise TensorParallelError(
            f"--tp {size} does not split this model: its {config.num_heads} query / {config.num_kv_heads} "
            f"KV heads (and MLP width {config.intermediate_size}) split into whole GQA groups for "
            f"--tp {', '.join(map(str, sizes))}"
        )


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank of `size` runs: heads, KV heads and the MLP's inner width divided."""
    check_size(config, size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def split_of(key: str, head: str = "replicated") -> int | None:
    """The dimension a checkpoint tensor is split along (0 or 1), or None: replicated (`head`: how
    the LM head is split, `HEAD_MODES`)."""
    if key == HEAD_KEY and head == "vocab":
        return 0
    parts = key.split(".")
    if not key.startswith("model.layers.") or len(parts) < 2:
        return None  # the embedding, final norm, LM head and draft layers
    module, kind = parts[-2], parts[-1]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and kind == "weight":
        return 1
    return None  # norms; the row-parallel biases (added once: rank 0's, zeros elsewhere)


def read_shard(files: Sequence[Path], keys: set[str] | None, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slices of the checkpoint's tensors (`keys`: those wanted, None: all): split ones
    through safetensors slices, so only the slice is ever read; replicated ones whole."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    if keys is not None and key not in keys:
                        continue
                    dim = split_of(key, tp.head if tp.size > 1 else "replicated")
                    if key == HEAD_KEY and dim == 0:
                        tensors[key] = _head_slice(handle.get_slice(key), tp)
                        continue
                    if dim is None:
                        tensor = handle.get_tensor(key)
                        if tp.rank and key.endswith(tuple(f"{m}.bias" for m in ROW_PARALLEL)):
                            tensor = torch.zeros_like(tensor)  # the all-reduce adds rank 0's once
                        tensors[key] = tensor
                        continue
                    part = handle.get_slice(key)
                    length = part.get_shape()[dim]
                    if length % tp.size:
                        raise TensorParallelError(
                            f"{key} has {length} {'rows' if dim == 0 else 'columns'}, not a multiple of "
                            f"--tp {tp.size}"
                        )
                    step = length // tp.size
                    window = slice(tp.rank * step, (tp.rank + 1) * step)
                    tensors[key] = part[window] if dim == 0 else part[:, window]
        except (SafetensorError, OSError) as error:
            raise TensorParallelError(
                f"{path} is not a readable safetensors file ({str(error).splitlines()[0]}): download the "
                "checkpoint again"
            ) from None
    return tensors


def _head_slice(part: Any, tp: TensorParallel) -> torch.Tensor:
    """This rank's rows of the LM head (a safetensors slice of [V, hidden]), zero rows past V."""
    vocab, hidden = part.get_shape()
    rows = tp.head_rows(vocab)
    start, stop = min(tp.rank * rows, vocab), min((tp.rank + 1) * rows, vocab)
    mine = part[start:stop]
    if stop - start == rows:
        return mine
    return torch.cat((mine, mine.new_zeros(rows - (stop - start), hidden)))


def write_rank_files(files: Sequence[Path], out_dir: Path, size: int, head: str = DEFAULT_HEAD) -> list[Path]:
    """Write each rank's slices of the checkpoint `files` (what `read_shard` gives rank r of `size`) to
    out_dir/rank-r.safetensors, its rank, size and head split in the file's metadata; the paths, in
    rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(size):
        tensors = read_shard(files, None, TensorParallel(rank, size, head=head))
        path = out_dir / f"rank-{rank}.safetensors"
        metadata = {"tp_rank": str(rank), "tp_size": str(size), "tp_head": head}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
        paths.append(path)
        del tensors  # one rank's slices in memory at a time
    return paths


def rank_file_head(path: Path) -> str:
    """How the LM head is split in a rank file of `build --tp N` ("replicated" in files without the
    record); "replicated" where the file cannot be read (`read_rank_file` then says why)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("tp_head", "replicated")
    except (SafetensorError, OSError):
        return "replicated"


def read_rank_file(path: Path, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's tensors from its file of an engine built with `build --tp N` (read whole: it holds
    this rank's slices only); a file of another rank or size is refused."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            written = (metadata.get("tp_rank"), metadata.get("tp_size"))
            if written != (str(tp.rank), str(tp.size)):
                raise TensorParallelError(
                    f"{path} holds rank {written[0]} of --tp {written[1]}, not rank {tp.rank} of --tp "
                    f"{tp.size}: rebuild the engine with `build --tp {tp.size}`"
                )
            written_head = metadata.get("tp_head", "replicated")  # files written before the split
            if written_head != tp.head:
                raise TensorParallelError(
                    f"{path} holds a {written_head} LM head, this run splits it {tp.head}: rebuild the "
                    f"engine with `build --tp {tp.size}`"
                )
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise TensorParallelError(
            f"{path} is not a readable safetensors file ({str(error).splitlines()[0]}): rebuild the engine"
        ) from None


class RowParallelLinear(Linear):
    """A row-parallel product: this rank's input columns, then the sum over the ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in / size] -> [..., out]
        return self.tp.all_reduce(super().forward(x).contiguous())


def make_row_parallel(model: nn.Module, tp: TensorParallel) -> None:
    """Replace every o_proj and down_proj `Linear` of a (meta-initialised) model by a
    `RowParallelLinear` of the same shape: same parameter names, so the checkpoint loads as before."""
    for module in list(model.modules()):
        for name in ROW_PARALLEL:
            old = getattr(module, name, None)
            if isinstance(old, Linear) and not isinstance(old, RowParallelLinear):
                new = RowParallelLinear(
                    old.in_features, old.out_features, old.bias is not None, tp, device=old.weight.device
                )
                setattr(module, name, new)


class VocabParallelHead(Linear):
    """The LM head split over the vocabulary: this rank's rows [rank * rows, (rank + 1) * rows) of
    [V, hidden] (zero rows past V), its logits, then one all-gather: logits [..., V] on every rank."""

    def __init__(self, in_features: int, vocab_size: int, tp: TensorParallel, **kwargs) -> None:
        super().__init__(in_features, tp.head_rows(vocab_size), bias=False, **kwargs)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., V]
        return self.tp.gather_last(super().forward(x))[..., : self.vocab_size]

    def tie(self, embedding: torch.Tensor) -> None:
        """Use this rank's rows of a tied embedding [V, hidden] (a view of it; a copy padded with zero
        rows where the slice runs past V)."""
        rows = self.out_features
        start = min(self.tp.rank * rows, self.vocab_size)
        mine = embedding[start : start + rows]
        if len(mine) < rows:
            mine = torch.cat((mine, mine.new_zeros(rows - len(mine), mine.shape[1])))
        self.weight = nn.Parameter(mine, requires_grad=False)


def make_vocab_parallel_head(model: nn.Module, tp: TensorParallel) -> None:
    """Under `tp.head == "vocab"`, replace a (meta-initialised) model's `lm_head` by a
    `VocabParallelHead` (same parameter name, this rank's rows); else leave it replicated."""
    old = getattr(model, "lm_head", None)
    if tp.splits_vocab and isinstance(old, Linear) and not isinstance(old, VocabParallelHead):
        model.lm_head = VocabParallelHead(old.in_features, old.out_features, tp, device=old.weight.device)


def config_digest(model_dir: Path) -> str:
    """A short hash of a model directory's config.json (ranks compare it before loading)."""
    path = Path(model_dir) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def init_group(
    rank: int,
    size: int,
    address: str,
    port: int,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    head: str | None = None,
) -> TensorParallel:
    """Join the default process group (TCP rendezvous at address:port); a collective that waits longer
    than `timeout_s` for another rank fails instead of hanging. `head`: how the LM head is split
    (`HEAD_MODES`; None: `default_head` of the backend)."""
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank, size, head=head or default_head(backend))


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters (each tensor once)."""
    seen: dict[int, int] = {}
    for parameter in module.parameters():
        seen[id(parameter)] = parameter.numel() * parameter.element_size()
    return sum(seen.values())


def rank_bytes(
    config: ModelConfig, size: int, positions: int, element: int, head: str = DEFAULT_HEAD
) -> tuple[int, int, int]:
    """What one rank of `size` holds for a model of `config`, `element` bytes per value (2: bf16):
    (replicated weights: embedding, LM head unless tied or split, norms; its slice of the split
    weights, the LM head's rows under `head="vocab"` unless tied; its full KV cache for `positions`
    positions). The draft layers (replicated, a few hidden x hidden products) are not counted."""
    check_size(config, size)
    hidden, inner, dim = config.hidden_size, config.intermediate_size, config.head_dim
    projections = dim * (config.num_heads + 2 * config.num_kv_heads)  # Q, K and V outputs
    attention = hidden * projections + config.num_heads * dim * hidden  # Q/K/V and O weights
    attention += projections if config.qkv_bias else 0
    split = config.num_layers * (attention + 3 * hidden * inner) // size
    head_weight = 0 if config.tie_word_embeddings else config.vocab_size * hidden
    splits_head = head == "vocab" and size > 1
    if splits_head:
        split += TensorParallel(0, size).head_rows(config.vocab_size) * hidden * bool(head_weight)
    replicated = config.vocab_size * hidden + (0 if splits_head else head_weight)
    replicated += (2 * config.num_layers + 1) * hidden
    kv = 2 * config.num_layers * (config.num_kv_heads // size) * dim * positions
    return replicated * element, split * element, kv * element
