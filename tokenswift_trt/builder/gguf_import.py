"""GGUF (llama.cpp) file -> a Hugging Face model directory that the runtime and transformers load.

Supported: architectures `llama` and `qwen2` (dense), every tensor type the `gguf` package can
dequantise, and byte-level BPE tokenizers (`tokenizer.ggml.model` "gpt2"). The directory holds
`config.json`, float32 `model.safetensors` (sharded with an index above `max_shard_bytes`),
`tokenizer.json`, `tokenizer_config.json` (with the chat template), `generation_config.json` and
`gguf_source.json` (the source file's name and sha256; written last, so its presence marks a
complete import).

Terms: llama.cpp's convert script stores a Llama's q/k projection rows permuted per head
(`w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`, with n_head = kv heads for k);
`unpermute_rows` is its exact inverse. Qwen2 rows are stored as they are. Llama 3.x rope scaling is
stored as a `rope_freqs.weight` tensor of per-frequency divisors, from which the `llama3` rope
parameters are recovered and checked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # gguf is imported when a file is read: importing this module stays cheap
    from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

Progress = Callable[[str, int, int], None]  # (stage, done, total)
Plan = list[tuple["ReaderTensor", str]]  # (GGUF tensor, Hugging Face name) for every weight

SOURCE_FILE = "gguf_source.json"
IMPORT_FORMAT = 1  # bump when the importer's output changes, so that stale imports are redone
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_TOKENIZERS = ("gpt2",)
DEFAULT_MAX_SHARD_BYTES = 4 << 30

# tokenizer.ggml.token_type values (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE (the groups llama.cpp's llama-vocab.cpp shares).
# "gpt2" is ByteLevel's own GPT-2 regex; "default" (files older than the key) is read as GPT-2, as
# transformers does; "smollm" splits digits one by one first.
PRE_TOKENIZER_STYLES = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), "smollm"),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "smaug-bpe", "dbrx", "pixtral"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), "qwen2"),
}
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")  # whole-word vocab hits first

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_IGNORED_TENSORS = re.compile(r"blk\.\d+\.attn_rot_embd\.weight")  # old files' rotary tables
ROPE_FREQS = "rope_freqs.weight"


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in spelling):
        spelling[byte] = chr(256 + offset)
    return spelling


BYTE_SPELLING = _byte_spelling()


class GGUFImportError(ValueError):
    """A GGUF file cannot be imported (the message names what is supported)."""


@dataclass(frozen=True)
class GGUFSource:
    """What `gguf_source.json` records about an import."""

    file: str  # the GGUF file's name
    sha256: str
    bytes: int
    architecture: str  # general.architecture
    tensor_types: dict[str, int]  # GGML type name -> number of tensors
    files: dict[str, int]  # files written next to gguf_source.json -> size in bytes
    import_format: int = IMPORT_FORMAT


def hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name, or None.

    `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.
    """
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"
    return None


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Exact inverse of llama.cpp's q/k row permutation.

    llama.cpp: `w.reshape(h, 2, rows // h // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
    """
    rows = weights.shape[0]
    if rows % (2 * num_heads):
        raise GGUFImportError(f"cannot undo the q/k permutation: {rows} rows, {num_heads} heads")
    grouped = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


def file_sha256(path: Path, progress: Progress | None = None) -> str:
    """sha256 of a file, reporting progress in MiB under the stage "hash gguf"."""
    digest = hashlib.sha256()
    total = max(1, math.ceil(path.stat().st_size / (1 << 20)))
    with open(path, "rb") as handle:
        for done, block in enumerate(iter(lambda: handle.read(1 << 20), b""), start=1):
            digest.update(block)
            if progress and (done % 64 == 0 or done == total):
                progress("hash gguf", done, total)
    return digest.hexdigest()


def read_source(model_dir: Path) -> GGUFSource | None:
    """The import record of `model_dir` when it holds a complete import (every file present, right size)."""
    path = Path(model_dir) / SOURCE_FILE
    try:
        source = GGUFSource(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    for name, size in source.files.items():
        file = Path(model_dir) / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return source


class GGUFMetadata:
    """A GGUF file's key/value metadata (`{arch}` in keys stands for general.architecture) and tensors."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader = reader
        self.path = path
        architecture = self.get("general.architecture")
        if not isinstance(architecture, str):
            raise GGUFImportError(f"{path} has no general.architecture: not a model GGUF")
        self.architecture = architecture

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key.format(arch=getattr(self, "architecture", "")))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self.path} lacks the metadata key {key.format(arch=self.architecture)}")
        return value


def open_gguf(gguf_path: Path) -> GGUFMetadata:
    """Read a GGUF file's header; refuses architectures other than llama/qwen2 and split files."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise GGUFImportError(f"{gguf_path} is not a readable GGUF file ({error})") from None
    meta = GGUFMetadata(reader, gguf_path)
    parts = meta.get("split.count", 1)
    if parts > 1:
        raise GGUFImportError(
            f"{gguf_path.name} is part of a {parts}-file split GGUF: merge it first "
            "(llama-gguf-split --merge)"
        )
    if meta.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{gguf_path.name} holds architecture {meta.architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return meta


def _dequantizable(tensor_type: GGMLQuantizationType) -> bool:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if tensor_type not in GGML_QUANT_SIZES:
        return False
    type_size = GGML_QUANT_SIZES[tensor_type][1]
    try:  # one all-zero block: cheap, and the gguf package's own answer
        dequantize(np.zeros((1, type_size), dtype=np.uint8), tensor_type)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def _check_tensor_types(meta: GGUFMetadata) -> dict[str, int]:
    from gguf import GGMLQuantizationType

    counts: dict[str, int] = {}
    for tensor in meta.reader.tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    for name in counts:
        if not _dequantizable(GGMLQuantizationType[name]):
            usable = [t.name for t in GGMLQuantizationType if _dequantizable(t)]
            raise GGUFImportError(
                f"{meta.path.name} has {name} tensors, which the gguf package cannot dequantise; supported: "
                f"{', '.join(usable)}"
            )
    return counts


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF dims are innermost-first
    values = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


# ---------------------------------------------------------------- config


def _float(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _llama3_divisors(
    inv_freq: np.ndarray, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.x rope scaling (the divisor of each frequency)."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, divisors)
    return np.where(wavelen > original / low, factor, divisors)


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int, original: int | None) -> dict[str, Any]:
    """The `llama3` rope parameters whose divisors are `divisors` (checked), from the smooth band."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv_freq.shape:
        raise GGUFImportError(
            f"{ROPE_FREQS} has {divisors.size} values; head_dim {head_dim} needs {inv_freq.size}"
        )
    factor = _float(divisors.max())
    candidates = []
    mid = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if mid.sum() >= 2:  # smooth = a / wavelen + b on the band; low_freq_factor 1 as in every Llama 3.x
        smooth = (1 / divisors[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_freq[mid] / (2 * math.pi), smooth, 1)
        if b < 0:
            candidates.append((1.0, round(1 - 1 / b, 4), round(-a / b)))
    for low, high, context in ((1.0, 4.0, original or 8192), (1.0, 4.0, 8192)):  # Llama 3.1 / 3.2 values
        candidates.append((low, high, context))
    for low, high, context in candidates:
        if high > low and context > 0:
            expected = _llama3_divisors(inv_freq, factor, low, high, context)
            if np.allclose(expected, divisors, rtol=1e-4, atol=0):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": int(context),
                }
    raise GGUFImportError(f"{ROPE_FREQS} holds rope factors that match no llama3 rope scaling: not supported")


def _rope(meta: GGUFMetadata, theta: float, head_dim: int) -> dict[str, Any]:
    original = meta.get("{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in meta.reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if meta.architecture != "llama":
            raise GGUFImportError(f"{ROPE_FREQS} in a {meta.architecture} GGUF is not supported")
        divisors = _dequantize(freqs).astype(np.float64)
        if np.allclose(divisors, 1.0):
            return {"rope_type": "default"}
        return _llama3_rope(divisors, theta, head_dim, original)
    kind = meta.get("{arch}.rope.scaling.type", "none")
    factor = meta.get("{arch}.rope.scaling.factor")
    if kind == "none" or not factor or factor == 1.0:
        return {"rope_type": "default"}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(factor)}
    if kind == "yarn":
        rope: dict[str, Any] = {"rope_type": "yarn", "factor": _float(factor)}
        if original:
            rope["original_max_position_embeddings"] = int(original)
        for key, name in (
            ("yarn_beta_fast", "beta_fast"),
            ("yarn_beta_slow", "beta_slow"),
            ("attn_factor", "attention_factor"),
        ):
            value = meta.get("{arch}.rope.scaling." + key)
            if value is not None:
                rope[name] = _float(value)
        return rope
    raise GGUFImportError(f"rope scaling {kind!r} is not supported; supported: none, linear, yarn, llama3")


def _eos_ids(meta: GGUFMetadata) -> list[int]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """config.json for the file's model (shapes from metadata, checked against the tensors later)."""
    names = {t.name for t in meta.reader.tensors}
    embedding = next((t for t in meta.reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise GGUFImportError(f"{meta.path.name} has no token_embd.weight tensor")
    hidden = int(meta.require("{arch}.embedding_length"))
    heads = int(meta.require("{arch}.attention.head_count"))
    kv_heads = meta.get("{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise GGUFImportError("per-layer kv head counts are not supported")
    head_dim = int(meta.get("{arch}.attention.key_length") or hidden // heads)
    value_dim = int(meta.get("{arch}.attention.value_length") or head_dim)
    rope_dim = meta.get("{arch}.rope.dimension_count")
    if value_dim != head_dim or (rope_dim is not None and int(rope_dim) != head_dim):
        raise GGUFImportError(
            f"head sizes key {head_dim}, value {value_dim}, rope {rope_dim}: "
            "only equal sizes (full rotary) are supported"
        )
    theta = _float(meta.get("{arch}.rope.freq_base", 10000.0))
    rope = _rope(meta, theta, head_dim)
    context = int(meta.get("{arch}.context_length") or 4096)
    vocab = int(embedding.shape[1])
    eos = _eos_ids(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHITECTURES[meta.architecture]],
        "model_type": meta.architecture,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require("{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": _float(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_parameters": {**rope, "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float32",
    }
    if rope["rope_type"] != "default":
        config["rope_scaling"] = dict(rope)
    if meta.architecture == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    else:
        config["use_sliding_window"] = False
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config


# ---------------------------------------------------------------- tokenizer


def _tokens(meta: GGUFMetadata) -> tuple[list[str], list[int]]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFImportError(f"{meta.path.name} has no tokenizer.ggml.tokens: cannot build its tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    return list(tokens), [int(t) for t in types]


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the one the file describes (byte-level BPE)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    embedded = meta.get("tokenizer.huggingface.json")
    if embedded:
        return Tokenizer.from_str(embedded)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise GGUFImportError(f"tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    style = PRE_TOKENIZER_STYLES.get(pre)
    if style is None:
        raise GGUFImportError(
            f"pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZER_STYLES))}"
        )
    tokens, types = _tokens(meta)
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFImportError(f"{meta.path.name} has no tokenizer.ggml.merges: cannot build a BPE tokenizer")
    alphabet = set(BYTE_SPELLING.values())
    vocab: dict[str, int] = {}
    for index, (token, kind_of) in enumerate(zip(tokens, types)):
        if kind_of == UNUSED:
            continue
        if kind_of == NORMAL and not set(token) <= alphabet:  # spelled as text: respell in the byte alphabet
            token = "".join(BYTE_SPELLING[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in IGNORE_MERGES))
    if style in ("gpt2", "smollm"):
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if style == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    else:
        split = _LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if style == "qwen2":
            tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types)
        if k in (CONTROL, UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED
    ]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(user)
    template = _template(meta, tokens, default_bos=style == "llama3")
    byte_level = processors.ByteLevel(trim_offsets=False)
    tokenizer.post_processor = processors.Sequence([byte_level, template]) if template else byte_level
    return tokenizer


def _adds(meta: GGUFMetadata, default_bos: bool) -> tuple[bool, bool]:
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    return (default_bos if add_bos is None else bool(add_bos)), bool(add_eos)


def _template(meta: GGUFMetadata, tokens: list[str], default_bos: bool) -> TemplateProcessing | None:
    from tokenizers import processors

    add_bos, add_eos = _adds(meta, default_bos)
    bos_id, eos_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    first = [tokens[bos_id]] if add_bos and bos_id is not None else []
    last = [tokens[eos_id]] if add_eos and eos_id is not None else []
    if not first and not last:
        return None
    single = " ".join(first + ["$A:0"] + last)
    pair = " ".join(first + ["$A:0"] + last + [f"{t}:1" for t in first] + ["$B:1"] + [f"{t}:1" for t in last])
    special = [(tokens[i], int(i)) for i, keep in ((bos_id, first), (eos_id, last)) if keep]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def tokenizer_files(meta: GGUFMetadata, tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and generation_config.json contents."""
    style = PRE_TOKENIZER_STYLES.get(meta.get("tokenizer.ggml.pre", "default"))
    add_bos, add_eos = _adds(meta, default_bos=style == "llama3")

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokenizer.id_to_token(int(index))

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("{arch}.context_length") or 4096),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    eos = _eos_ids(meta)
    generation: dict[str, Any] = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        generation["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    return {"tokenizer_config.json": tokenizer_config, "generation_config.json": generation}


# ---------------------------------------------------------------- weights


def _plan_tensors(meta: GGUFMetadata, config: dict[str, Any]) -> Plan:
    """(GGUF tensor, HF name) for every weight, checked against the runtime's model for this config."""
    import torch

    from tokenswift_trt.model.config import ConfigError, config_from_dict
    from tokenswift_trt.model.decoder import LlamaModel

    try:
        model_config = config_from_dict(config)
    except ConfigError as error:
        raise GGUFImportError(f"{meta.path.name}: {error}") from None
    with torch.device("meta"):
        model = LlamaModel(model_config, device="meta")
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model_config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    plan = []
    for tensor in meta.reader.tensors:
        if tensor.name == ROPE_FREQS or _IGNORED_TENSORS.fullmatch(tensor.name):
            continue
        name = hf_tensor_name(tensor.name)
        if name is None or name not in expected:
            raise GGUFImportError(
                f"tensor {tensor.name} has no counterpart in {config['architectures'][0]} "
                "(dense llama/qwen2 GGUFs only)"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != expected[name]:
            raise GGUFImportError(
                f"tensor {tensor.name} has shape {shape}; the metadata implies {expected[name]}"
            )
        plan.append((tensor, name))
    missing = sorted(set(expected) - {name for _, name in plan})
    if missing:
        raise GGUFImportError(
            f"{meta.path.name} lacks {len(missing)} tensor(s); first: {', '.join(missing[:3])}"
        )
    return plan


def _shards(plan: Plan, max_shard_bytes: int) -> list[Plan]:
    shards: list[Plan] = [[]]
    size = 0
    for item in plan:
        nbytes = int(item[0].n_elements) * 4
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _write_weights(
    meta: GGUFMetadata,
    config: dict[str, Any],
    directory: Path,
    max_shard_bytes: int,
    progress: Progress | None,
) -> None:
    from safetensors.numpy import save_file

    plan = _plan_tensors(meta, config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}  # llama.cpp permuted a Llama's rows
    if meta.architecture != "llama":
        permuted = {}
    shards = _shards(plan, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    done = 0
    for shard, file_name in zip(shards, names):
        tensors: dict[str, np.ndarray] = {}
        for tensor, name in shard:
            values = _dequantize(tensor)
            module = name.rsplit(".", 1)[0].split(".", 3)[-1]  # e.g. self_attn.q_proj
            if module in permuted:
                values = unpermute_rows(values, permuted[module])
            tensors[name] = values
            weight_map[name] = file_name
            done += 1
            if progress:
                progress("dequantize", done, len(plan))
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        total = sum(int(t.n_elements) * 4 for t, _ in plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------- import


def _default_permissions(directory: Path) -> None:
    """What a plain mkdir/open would have given (mkdtemp and safetensors write owner-only files)."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~mask)


def import_gguf(
    gguf_path: Path,
    out_dir: Path,
    progress: Progress | None = None,
    *,
    force: bool = False,
    expected_sha256: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Import `gguf_path` into the Hugging Face directory `out_dir` (written whole or not at all).

    `force` replaces an existing `out_dir`; `expected_sha256` refuses a file with another digest.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise GGUFImportError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise GGUFImportError(f"{out_dir} already exists: remove it or pass force=True")
    meta = open_gguf(gguf_path)
    tensor_types = _check_tensor_types(meta)
    config = hf_config(meta)
    tokenizer = build_tokenizer(meta)
    _plan_tensors(meta, config)  # every name and shape, before any slow work
    digest = file_sha256(gguf_path, progress)
    if expected_sha256 is not None and digest != expected_sha256:
        raise GGUFImportError(f"{gguf_path} has sha256 {digest}, expected {expected_sha256}: reinstall it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        _write_weights(meta, config, staging, max_shard_bytes, progress)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(staging / "tokenizer.json"))
        for name, content in tokenizer_files(meta, tokenizer).items():
            (staging / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        source = GGUFSource(
            file=gguf_path.name,
            sha256=digest,
            bytes=gguf_path.stat().st_size,
            architecture=meta.architecture,
            tensor_types=tensor_types,
            files=files,
        )
        (staging / SOURCE_FILE).write_text(json.dumps(asdict(source), indent=2) + "\n")
        _default_permissions(staging)
        if out_dir.is_dir():
            shutil.rmtree(out_dir)
        elif out_dir.exists():
            out_dir.unlink()
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir
