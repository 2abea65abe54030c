"""Load a Hugging Face model directory (+ optional draft-layer heads file) into a runnable engine.

Every checkpoint key and shape is checked against the model built from `config.json` before any
weight is used; tensors are read through safetensors' memory map onto a meta-initialised model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenswift_trt.kernels import ops as kernels
from tokenswift_trt.kernels import prefix_config
from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig, load_config
from tokenswift_trt.model.decoder import Decoder, LlamaModel
from tokenswift_trt.model.draft_layers import (
    DraftLayers,
    DraftLayout,
    draft_key,
    draft_layout,
    read_heads_file,
)
from tokenswift_trt.model.linear import pack_linears
from tokenswift_trt.model.tensor_parallel import (
    TensorParallel,
    make_row_parallel,
    make_vocab_parallel_head,
    rank_file_head,
    read_rank_file,
    read_shard,
    shard_config,
)


class WeightsError(ValueError):
    """A checkpoint does not match the model its config describes."""


class UntrainedDraftLayersWarning(UserWarning):
    """The engine runs with zero-initialised draft layers: lossless, but acceptance will be low."""


class KernelFallbackWarning(UserWarning):
    """On CUDA, the tree-attention kernel could not be used; attention runs through SDPA (same results)."""


@dataclass
class Engine:
    config: ModelConfig
    model: Decoder  # LlamaModel, or an exported-graph decoder (engine_dir.py)
    draft_layers: DraftLayers
    trained_draft_layers: bool
    dtype: torch.dtype
    device: torch.device
    fingerprint: str = ""  # `model_fingerprint`: which model this is ("" = not known)
    kernels: KernelConfig = KernelConfig()  # the kernel and fusion choices it was loaded with

    def model_parameters(self) -> list[torch.nn.Parameter]:
        """Base and draft-layer parameters (for memory accounting; onnx/TensorRT keep the torch copy too)."""
        model = self.model.torch_model
        return list(model.parameters()) + list(self.draft_layers.parameters())


DEFAULT_HEADS_FILE = "heads.safetensors"  # picked up from the model directory when present
_IGNORED_KEYS = re.compile(r".*rotary_emb\.inv_freq$")


def has_draft_layers(model_dir: Path, heads_file: Path | None = None) -> bool:
    """Whether `load_engine` would find draft layers for `model_dir` (a heads file given or in the
    directory, or the checkpoint's released-format keys), read from file names and safetensors
    headers only."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if heads_file is not None or (model_dir / DEFAULT_HEADS_FILE).is_file():
        return True
    try:
        files = _safetensors_files(model_dir)
    except (WeightsError, OSError):
        return False
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                if any(draft_key(key) is not None for key in handle.keys()):
                    return True
        except (OSError, SafetensorError):
            continue
    return False


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise WeightsError(
                f"{index} is corrupt ({_first_line(error)}): download the checkpoint's index again"
            ) from None
        files = [model_dir / name for name in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        files = [f for f in files if not f.name.startswith("heads")]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightsError(f"missing weight shard(s): {', '.join(missing)}")
    if not files:
        raise WeightsError(
            f"no *.safetensors weights in {model_dir}: expected model.safetensors or a sharded index"
        )
    return files


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise WeightsError(
                f"{path} is not a readable safetensors file ({_first_line(error)}): it is truncated or "
                "corrupt; download the checkpoint again (or rebuild the engine)"
            ) from None
    return tensors


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def model_fingerprint(config: ModelConfig, model_dir: Path, embedding: torch.Tensor) -> str:
    """A short hash naming a model: its config (draft layers aside), tokenizer and a sample of its
    embedding rounded to bfloat16 (the same in every engine dtype built from one checkpoint), for
    journals to tell the model that wrote them."""
    digest = hashlib.sha256()
    shape = {k: v for k, v in dataclasses.asdict(config).items() if k != "num_draft_layers"}
    digest.update(json.dumps(shape, sort_keys=True).encode())
    tokenizer = model_dir / "tokenizer.json"
    if tokenizer.is_file():
        digest.update(tokenizer.read_bytes())
    flat = embedding.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 4096)][:4096]
    digest.update(sample.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def _check_and_assign(
    module: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    what: str,
    dtype: torch.dtype,
    device: torch.device,
    mismatch: str = "",
) -> None:
    """Load `tensors` into `module` after checking their names and shapes; `mismatch` is said after a
    shape that differs (what such a file is and what to give instead)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise WeightsError(f"{what}: {len(missing)} missing weight(s), first: {', '.join(missing[:3])}")
    if unexpected:
        raise WeightsError(
            f"{what}: {len(unexpected)} unexpected weight(s), first: {', '.join(unexpected[:3])}"
        )
    for key, tensor in tensors.items():
        want = tuple(expected[key].shape)
        if tuple(tensor.shape) != want:
            raise WeightsError(
                f"{what}: {key} has shape {tuple(tensor.shape)}, the config implies {want}{mismatch}"
            )
    module.load_state_dict({k: _placed(v, dtype, device) for k, v in tensors.items()}, assign=True)


def _placed(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A weight in the engine's dtype on its device; integer tensors (token ids) keep their type."""
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def load_engine(
    model_dir: str | Path,
    heads_file: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kernels: KernelConfig = KernelConfig(),
    tp: TensorParallel | None = None,
    rank_file: Path | None = None,
) -> Engine:
    """Load base weights and draft layers; zero-initialised draft layers (with a warning) when none exist.

    Draft layers come from `heads_file`, else from the checkpoint's released-format keys, else
    from `heads.safetensors` in the model directory. `kernels` chooses the kernels and fusions.
    `tp`: this rank of a tensor-parallel group; its slices of the layers only (tensor_parallel.py),
    read from `rank_file` (an engine built with `build --tp N`) when given, else from the checkpoint.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise WeightsError(f"model directory {model_dir} does not exist")
    config = full_config = load_config(model_dir)
    if tp is not None:  # tensor parallel: this rank's shape (heads, KV heads, MLP width / size)
        config = shard_config(config, tp.size)
        if rank_file is not None:  # an engine's rank files fix how its LM head is split
            tp = dataclasses.replace(tp, head=rank_file_head(rank_file))
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaModel(config, device="meta")
        if tp is not None:
            make_row_parallel(model, tp)  # o_proj and down_proj end in an all-reduce
            make_vocab_parallel_head(model, tp)  # under head="vocab": this rank's rows, an all-gather
    if tp is not None and rank_file is not None:
        tensors = read_rank_file(rank_file, tp)
    else:
        files = _safetensors_files(model_dir)
        tensors = _read_tensors(files) if tp is None else read_shard(files, None, tp)
    base = {k: v for k, v in tensors.items() if draft_key(k) is None and not _IGNORED_KEYS.match(k)}
    draft = {draft_key(k): v for k, v in tensors.items() if draft_key(k) is not None}
    if config.tie_word_embeddings:
        base.pop("lm_head.weight", None)
    _check_and_assign_base(model, base, config, dtype, device)
    fingerprint = model_fingerprint(full_config, model_dir, model.model.embed_tokens.weight)

    if heads_file is None and not draft and (model_dir / DEFAULT_HEADS_FILE).is_file():
        heads_file = model_dir / DEFAULT_HEADS_FILE
    if heads_file is not None:
        heads_path = Path(heads_file)
        if not heads_path.is_file():
            raise WeightsError(f"heads file {heads_path} does not exist")
        try:
            draft = {draft_key(k) or k: v for k, v in read_heads_file(heads_path).items()}
        except (SafetensorError, OSError) as error:
            raise WeightsError(
                f"heads file {heads_path} is not a readable safetensors file ({_first_line(error)}): "
                "train it again with `tokenswift-trt train-heads` (or download it again)"
            ) from None
        except ValueError as error:
            raise WeightsError(str(error)) from None
    layout = draft_layout(draft) if draft else DraftLayout(config.num_draft_layers, False, 0)
    if layout.path_width and not layout.root_conditioned:
        raise WeightsError("draft layers: a path input needs a root input (root-conditioned layers) too")
    draft_layers = DraftLayers(
        config,
        layout.num_layers,
        layout.root_conditioned,
        layout.vocab_size,
        layout.root_width,
        layout.path_width,
    ).to(device=device, dtype=dtype)
    if draft:
        mismatch = (
            ": these draft layers belong to another model; give ones trained for this one "
            "(`tokenswift-trt train-heads`) or none"
        )
        _check_and_assign(draft_layers, draft, "draft layers", dtype, device, mismatch)
    else:
        draft_layers.zero_()
        warnings.warn(
            f"{model_dir} has no draft layers: running with zero-initialised ones, output stays exact "
            "but acceptance will be low (train them with `tokenswift-trt train-heads`)",
            UntrainedDraftLayersWarning,
            stacklevel=2,
        )
    model.rotary.to(device)
    model.eval()
    draft_layers.eval()
    choose_kernels(model, config, dtype, device, kernels)
    model.pack(kernels)  # CPU only: prepacked, fused weights (linear.py)
    if tp is not None:  # the compiled CPU stack runs every layer in one call: no room for all-reduces
        model.cpu_decoder = None
    # drafts never change the output: half the bytes per draft pass
    pack_linears(draft_layers, half=True, kernels=kernels)
    vocab = draft_layers.vocab
    if vocab is not None and (
        vocab.is_floating_point() or int(vocab.min()) < 0 or int(vocab.max()) >= config.vocab_size
    ):
        raise WeightsError(
            f"draft layers: the draft vocabulary holds ids outside 0..{config.vocab_size - 1}: "
            "rebuild it for this model with `tokenswift-trt draft-vocab`"
        )
    # only where the heads file has a draft vocabulary; under a split head, this rank's rows of it
    split = tp if tp is not None and tp.splits_vocab else None
    draft_layers.use_vocab_head(model.lm_head.weight, split, config.vocab_size)
    return Engine(config, model, draft_layers, bool(draft), dtype, device, fingerprint, kernels)


def choose_kernels(
    model: LlamaModel, config: ModelConfig, dtype: torch.dtype, device: torch.device, settings: KernelConfig
) -> None:
    """Every kernel and fusion choice of `settings` that applies on this device, as `load_engine` makes
    them (the CPU packing aside: `LlamaModel.pack`)."""
    choose_attention_kernel(model, config, dtype, device, settings)
    choose_fused_elementwise(model, dtype, device, settings)
    choose_batch_invariant(model, dtype, device, settings)
    batched = settings.batched_forward
    model.batched_forward = batched == "on" or (batched == "auto" and device.type == "cuda")


def choose_fused_elementwise(
    model: LlamaModel, dtype: torch.dtype, device: torch.device, settings: KernelConfig = KernelConfig()
) -> None:
    """With `fused_elementwise` (the default), on CUDA with float16/bfloat16: fewer kernels per layer
    (`LlamaModel.use_fused_elementwise`: add + RMSNorm, rotary and SiLU·up as one kernel each, Q/K/V
    and gate/up as one product each: fewer launches, the same function; docs/gpu.md); off, the
    PyTorch ops run."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return
    if not settings.fused_elementwise:
        return
    status = kernels.load_cuda_kernels()
    if status.loaded:
        model.use_fused_elementwise(True)
        return
    warnings.warn(
        f"fused elementwise kernels not used ({status.reason}); the PyTorch ops run",
        KernelFallbackWarning,
        stacklevel=3,
    )


def choose_batch_invariant(
    model: LlamaModel, dtype: torch.dtype, device: torch.device, settings: KernelConfig = KernelConfig()
) -> None:
    """With `batch_invariant` `on`, on CUDA: the base model's products through `triton_linear`, its
    norms one block per row and its steps' attention position-aligned (`triton_aligned`;
    `LlamaModel.use_batch_invariant`), so that a row's logits are the same bits in an AR step and in a
    verify; `products` leaves attention as it was. Off by default: the invariant products cost more
    than the default ones (docs/method.md, "In bf16 on a GPU")."""
    mode = settings.batch_invariant
    if device.type != "cuda" or mode == "off":
        return
    status = kernels.load_cuda_kernels()
    if importlib.util.find_spec("triton") is None or not status.loaded:
        reason = "Triton is not installed" if status.loaded else status.reason
        warnings.warn(
            f"batch-invariant products not used ({reason}); cuBLAS and PyTorch's norms run",
            KernelFallbackWarning,
            stacklevel=3,
        )
        return
    model.use_batch_invariant(True, attention=mode == "on")


def flash_cascade_problem(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why the FlashAttention cascade (`cascade.flash_cascade_attention`) cannot verify here, or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention takes float16/bfloat16, not {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"FlashAttention takes head_dim a multiple of 8 up to 256, not {head_dim}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "FlashAttention needs an sm_80 or newer GPU"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"PyTorch {torch.__version__} has no aten._flash_attention_forward"
    return None


def choose_attention_kernel(
    model: LlamaModel,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    settings: KernelConfig = KernelConfig(),
) -> None:
    """Verify through a tree-attention kernel: on CUDA with fp16/bf16 and a supported head size; on a
    CPU with float32, head_dim 16/32/64/128 and AVX2/AVX-512 (compiled on first use; `cpu_kernel` `off`
    keeps SDPA, `on` takes the kernel on any processor). On CUDA (`cuda_attention`): `auto`, the
    default, verifies wide trees over long contexts through the FlashAttention cascade
    (`cascade.flash_cascade_attention`, T x keys >= `cascade_min_work`) and everything else through the
    kernel; `kernel` never takes the cascade; `flash_cascade` takes it for every tree."""
    if device.type == "cpu":
        if (
            not kernels.cpu_kernel_supports(dtype, config.head_dim)
            or settings.cpu_kernel == "off"
            or not (settings.cpu_kernel == "on" or kernels.cpu_attention_kernel_pays())
        ):
            return
        status = kernels.load_cpu_kernels()
        if status.loaded:
            model.use_attention_kernel("cpu_tree_attention")
            return
        warnings.warn(
            f"CPU tree-attention kernel not used ({status.reason}); attention runs through SDPA",
            KernelFallbackWarning,
            stacklevel=3,
        )
        return
    if device.type != "cuda":
        return
    wanted = settings.cuda_attention
    if not kernels.kernel_supports(dtype, config.head_dim):
        problem = f"the kernel covers float16/bfloat16 and head_dim {kernels.SUPPORTED_HEAD_DIMS}"
    else:
        status = kernels.load_cuda_kernels()
        problem = (
            kernels.shared_memory_problem(status, config.head_dim, device) if status.loaded else status.reason
        )
        if status.loaded and status.module is not None:  # row tiles per warp (0: the kernel's own choice)
            status.module.set_tree_row_tiles(settings.tree_row_tiles)  # type: ignore[attr-defined]
    tail = settings.cascade_tail
    asked = settings.cascade_prefix
    prefix = "triton" if asked == "auto" else asked
    _, launch = prefix_config.parse_prefix_backend(prefix)  # checked when the KernelConfig was made
    if launch is not None and launch.variant == "tma" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:  # refused here, not at the first verify inside a graph capture
            raise ValueError(
                f"kernel setting cascade_prefix: the `tma` prefix kernel needs a Hopper or later GPU (this "
                f"one is sm_{major}{minor}): take `split` or `loads`"
            )
    if prefix.startswith("triton") and (
        importlib.util.find_spec("triton") is None
        or config.head_dim not in prefix_config.TRITON_PREFIX_HEAD_DIMS
    ):
        if asked != "auto":  # asked for by name: say why not (the default is quiet)
            warnings.warn(
                f"cascade_prefix={asked} needs Triton (it comes with CUDA builds of PyTorch) and "
                f"head_dim {prefix_config.TRITON_PREFIX_HEAD_DIMS} (this model's: {config.head_dim}); "
                "the prefix block runs through FlashAttention",
                KernelFallbackWarning,
                stacklevel=3,
            )
        prefix = "flash"
    min_work = settings.cascade_min_work
    if wanted != "kernel":
        cascade_problem = flash_cascade_problem(dtype, config.head_dim, device)
        if cascade_problem is None:
            if problem is None:  # the tree kernel below the threshold (measured against it)
                model.use_flash_cascade(min_work if wanted == "auto" else 0, "tree_attention")
            else:  # SDPA over the whole capacity would be the fallback: the cascade for every tree instead
                warnings.warn(
                    f"tree-attention kernel not used ({problem}); trees verify through the FlashAttention "
                    "cascade",
                    KernelFallbackWarning,
                    stacklevel=3,
                )
                model.use_flash_cascade(0, "sdpa")
            model.cascade_fused_tail = tail == "kernel"
            model.cascade_prefix = prefix
            return
        if wanted == "flash_cascade":  # asked for by name: say why not
            warnings.warn(
                f"flash_cascade attention not used ({cascade_problem}); trying the tree-attention kernel",
                KernelFallbackWarning,
                stacklevel=3,
            )
    if problem is None:
        model.use_attention_kernel("tree_attention")
        return
    warnings.warn(
        f"tree-attention kernel not used ({problem}); attention runs through SDPA",
        KernelFallbackWarning,
        stacklevel=3,
    )


def _check_and_assign_base(
    model: LlamaModel,
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if config.tie_word_embeddings:
        # the tied head is not a separate tensor: check and load the rest, then re-tie
        head = model.lm_head
        model.lm_head = torch.nn.Identity()  # type: ignore[assignment]
        try:
            _check_and_assign(model, tensors, "base model", dtype, device)
        finally:
            model.lm_head = head
        model.tie_weights()
    else:
        _check_and_assign(model, tensors, "base model", dtype, device)
