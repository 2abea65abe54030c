"""Tiny Hugging Face checkpoints for tests, written with transformers' own model classes."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenswift_trt.kernels.tree_mask import pack_tree_mask
from tokenswift_trt.model.paged_cache import PagedSequence, PagePool

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)


def llama_config(**overrides):
    """Tiny GQA Llama, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **overrides})


def qwen2_config(**overrides):
    """Tiny GQA Qwen2: qkv bias and tied embeddings."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **overrides})


def save_hf_model(config, directory: Path, seed: int = 0):
    """Build a random transformers model for `config`, save it to `directory`, return it (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases so that their loading is checked
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    model.save_pretrained(directory)
    return model


# the paper's static tree (drafted on the partial cache): tests of the partial-cache path pin it,
# since a request without a tree runs `--tree auto`
PAPER_TREE = "1,3,3,3"


def huge_pages_granted() -> bool:
    """Whether this kernel backs memory advised with MADV_HUGEPAGE by 2 MB pages (THP not "never")."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def huge_page_kib(address: int) -> int:
    """AnonHugePages of this process's mapping holding `address` (/proc/self/smaps), in KiB; 0 if none."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return 0


PAGED_KV_HEADS, PAGED_HEAD_DIM, PAGED_PAGE = 2, 8, 4  # the paged-attention tests' shapes


def paged_batch(generator: torch.Generator, heads: int = 4):
    """Three requests in one pool: a tree after 13 committed positions, an AR step after 30, a causal
    chunk of 3 on an empty request. -> (query, pages, tables, prefixes, counts, masks, requests)."""
    pool = PagePool(1, PAGED_KV_HEADS, PAGED_HEAD_DIM, 64, PAGED_PAGE, torch.float32)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    shapes = [(13, tree), (30, torch.ones(1, 1, dtype=torch.bool)), (0, torch.ones(3, 3).tril().bool())]
    requests = []
    for prefix, mask in shapes:
        sequence = PagedSequence(pool)
        for count in (prefix, mask.shape[0]):
            if count:
                sequence.reserve(count)
                keys = torch.randn(PAGED_KV_HEADS, count, PAGED_HEAD_DIM, generator=generator)
                sequence.write(
                    0, keys, torch.randn(PAGED_KV_HEADS, count, PAGED_HEAD_DIM, generator=generator)
                )
                if count == prefix:
                    sequence.commit()
        requests.append((sequence, mask))
    width = max(len(s.pages) for s, _ in requests)
    tables = torch.stack([s.table(width) for s, _ in requests])
    prefixes = torch.tensor([s.length for s, _ in requests], dtype=torch.int32)
    counts = torch.tensor([m.shape[0] for _, m in requests], dtype=torch.int32)
    words = torch.cat([pack_tree_mask(m) for _, m in requests])
    query = torch.randn(int(counts.sum()), heads, PAGED_HEAD_DIM, generator=generator)
    return query, pool, tables, prefixes, counts, words, requests
