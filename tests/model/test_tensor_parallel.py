"""Tensor parallelism (model/tensor_parallel.py): the valid sizes from a model's heads, each rank's
slices of the checkpoint, and two real gloo ranks decoding the single process's tokens, the LM head
replicated or split over the vocabulary."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from tokenswift_trt.decode.config import GenerationConfig
from tokenswift_trt.decode.loop import generate
from tokenswift_trt.model.config import config_from_dict, load_config
from tokenswift_trt.model.draft_layers import VocabHead
from tokenswift_trt.model.engine import UntrainedDraftLayersWarning, load_engine
from tokenswift_trt.model.sampling import SamplingConfig
from tokenswift_trt.model.tensor_parallel import (
    HEAD_MODES,
    TensorParallel,
    TensorParallelError,
    check_size,
    default_head,
    init_group,
    parameter_bytes,
    rank_bytes,
    read_shard,
    shard_config,
    split_of,
    valid_sizes,
    write_rank_files,
)

ROOT = Path(__file__).resolve().parents[2]
SWIFT_TINY = ROOT / "models" / "swift-tiny"
SMOLLM2_CONFIG = {  # models/smollm2-135m/config.json's shape (the test needs no weights)
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
PROMPT = list(range(40, 90))
# (method, sampling, tree): greedy and seeded sampling, AR and TokenSwift (static trees, partial cache)
RUNS = [
    ("ar", SamplingConfig(temperature=0.0), "auto"),
    ("ar", SamplingConfig(temperature=0.9, top_p=0.9), "auto"),
    ("tokenswift", SamplingConfig(temperature=0.0), "1,3,2,1"),
    ("tokenswift", SamplingConfig(temperature=0.9, top_p=0.9), "3,2,1"),
]


def test_valid_sizes_keep_gqa_groups_whole():
    smollm2 = config_from_dict(SMOLLM2_CONFIG)
    assert valid_sizes(smollm2) == [1, 3]
    check_size(smollm2, 3)
    with pytest.raises(TensorParallelError) as refused:
        check_size(smollm2, 2)
    message = str(refused.value)
    assert "\n" not in message and "9 query / 3 KV heads" in message and "--tp 1, 3" in message
    tiny = load_config(SWIFT_TINY)
    assert valid_sizes(tiny) == [1, 2]
    rank_shape = shard_config(tiny, 2)
    assert (rank_shape.num_heads, rank_shape.num_kv_heads, rank_shape.intermediate_size) == (4, 1, 384)
    assert rank_shape.kv_group_size == tiny.kv_group_size


def test_split_of_names_column_row_and_replicated_tensors():
    assert split_of("model.layers.3.self_attn.q_proj.weight") == 0
    assert split_of("model.layers.3.self_attn.k_proj.bias") == 0  # Qwen2's Q/K/V biases
    assert split_of("model.layers.3.mlp.up_proj.weight") == 0
    assert split_of("model.layers.3.self_attn.o_proj.weight") == 1
    assert split_of("model.layers.3.mlp.down_proj.weight") == 1
    for replicated in (
        "model.layers.3.mlp.down_proj.bias",
        "model.layers.3.input_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "tokenswift_heads.0.mlp.down_proj.weight",
    ):
        assert split_of(replicated) is None
    assert split_of("lm_head.weight", "vocab") == 0  # the head split over the vocabulary
    assert split_of("model.embed_tokens.weight", "vocab") is None  # the embedding stays whole


@pytest.mark.parametrize("head", HEAD_MODES)
def test_ranks_read_slices_that_make_the_whole_checkpoint(head):
    files = [SWIFT_TINY / "model.safetensors"]
    shards = [read_shard(files, None, TensorParallel(rank, 2, head=head)) for rank in range(2)]
    with safe_open(str(files[0]), framework="pt") as handle:
        for key in handle.keys():
            whole = handle.get_tensor(key)
            dim = split_of(key, head)
            if dim is None:
                assert all(torch.equal(shard[key], whole) for shard in shards), key
            else:
                assert shards[0][key].shape[dim] * 2 == whole.shape[dim], key
                assert torch.equal(torch.cat([shard[key] for shard in shards], dim), whole), key


def test_a_vocabulary_that_does_not_divide_pads_the_last_ranks_slice():
    files = [SWIFT_TINY / "model.safetensors"]
    with safe_open(str(files[0]), framework="pt") as handle:
        whole = handle.get_tensor("lm_head.weight")  # [8192, 256]
    slices = [read_shard(files, {"lm_head.weight"}, TensorParallel(r, 3, head="vocab")) for r in range(3)]
    rows = [part["lm_head.weight"] for part in slices]
    assert [len(part) for part in rows] == [2731, 2731, 2731]  # ceil(8192 / 3) each: 1/3 of the head
    assert torch.equal(torch.cat(rows)[:8192], whole)
    assert torch.equal(rows[2][-1], torch.zeros(256))  # one zero row past the vocabulary


def test_a_tied_head_split_over_the_vocabulary_is_a_slice_of_the_replicated_embedding(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(SWIFT_TINY / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = (SWIFT_TINY / "config.json").read_text()
    (tmp_path / "config.json").write_text(
        config.replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    )
    for rank in range(2):  # loading runs no collective: no process group needed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
            model = load_engine(tmp_path, tp=TensorParallel(rank, 2, head="vocab")).model.torch_model
        embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert tuple(embedding.shape) == (8192, 256) and tuple(head.shape) == (4096, 256)
        assert torch.equal(head, embedding[rank * 4096 : (rank + 1) * 4096])
        assert head.data_ptr() == embedding[rank * 4096 :].data_ptr()  # a view: no second copy
        assert model.screened_head is None  # a slice cannot be screened: the head runs in full


def test_the_head_splits_over_the_vocabulary_on_gpus_and_an_engines_rank_files_fix_the_split(tmp_path):
    assert default_head("nccl") == "vocab" and default_head("gloo") == "replicated"
    written = write_rank_files([SWIFT_TINY / "model.safetensors"], tmp_path, 2, head="vocab")
    for rank, path in enumerate(written):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
            # asked for a replicated head, the files' split wins: they hold 1/2 of the head's rows
            engine = load_engine(SWIFT_TINY, tp=TensorParallel(rank, 2, head="replicated"), rank_file=path)
        assert tuple(engine.model.torch_model.lm_head.weight.shape) == (4096, 256)
    with pytest.raises(TensorParallelError, match="must be one of replicated, vocab"):
        TensorParallel(0, 2, head="rows")


class _SideBySide:
    """Stands in for the ranks of a split head: gather_last returns what every rank computed."""

    def __init__(self, rank: int, size: int, parts: list) -> None:
        self.rank, self.size, self.parts = rank, size, parts

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank] = x
        return torch.cat(self.parts, dim=-1)


def test_a_draft_vocabulary_under_a_split_head_gives_the_whole_heads_logits():
    torch.manual_seed(0)
    weight = torch.randn(10, 8)  # V = 10 over 3 ranks: 4 rows each, the last 2 real
    ids = torch.tensor([0, 2, 3, 5, 8, 9])  # ranks hold 3, 1 and 2 of them
    states = torch.randn(2, 5, 8)
    expected = VocabHead.of(ids, weight)(states)  # [2, 5, 10]
    padded = torch.cat((weight, torch.zeros(2, 8)))
    heads = [VocabHead.of(ids, padded[r * 4 : (r + 1) * 4], _SideBySide(r, 3, []), 10) for r in range(3)]
    parts = [head.linear(states) for head in heads]  # [2, 5, 3] each: the widest rank's count
    for head in heads:
        head.tp.parts = list(parts)
        torch.testing.assert_close(head(states), expected, rtol=0, atol=1e-6)


def _load(tp: TensorParallel | None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntrainedDraftLayersWarning)
        return load_engine(SWIFT_TINY, tp=tp)


def _decode(engine) -> list[list[int]]:
    outputs = []
    for method, sampling, tree in RUNS:
        config = GenerationConfig(
            max_new_tokens=48,
            method=method,
            sampling=sampling,
            tree=tree,
            seed=11,
            ignore_eos=True,
            kv_budget=32,  # the partial cache reselects: each rank scores its own KV heads
        )
        outputs.append(generate(engine, PROMPT, config)[0])
    return outputs


def _layer_bytes(engine) -> int:
    """Bytes of the split tensors (Q/K/V, O, gate/up, down); the rest is replicated."""
    model = engine.model.torch_model
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if split_of(n) is not None)


def _rank(rank: int, port: int, head: str, results) -> None:
    torch.set_num_threads(1)
    tp = init_group(rank, 2, "127.0.0.1", port, timeout_s=60, head=head)
    engine = _load(tp)
    model = engine.model.torch_model
    hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), _cache(engine)).hidden
    logits = model.logits(hidden[-1:])  # [1, V]: every rank's own bits
    every = [torch.empty_like(logits) for _ in range(2)]
    torch.distributed.all_gather(every, logits)
    results.put(
        (
            rank,
            {
                "tokens": _decode(engine),
                "layer_bytes": _layer_bytes(engine),
                "bytes": parameter_bytes(model),
                "ranks_equal": torch.equal(every[0], every[1]),
                "logits": logits.tolist(),  # not a tensor: its shared memory ends with the process
                "kv_heads": engine.config.num_kv_heads,
                "head_bytes": parameter_bytes(model.lm_head),
            },
        )
    )
    torch.distributed.destroy_process_group()


def _cache(engine):
    from tokenswift_trt.model.kv_cache import KVCache

    c = engine.config
    return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(PROMPT), engine.dtype, engine.device)


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("head", HEAD_MODES)
def test_two_gloo_ranks_decode_the_single_process_tokens_with_half_the_layer_weights_each(head):
    torch.set_num_threads(1)
    single = _load(None)
    expected = _decode(single)
    model = single.model.torch_model
    hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), _cache(single)).hidden
    reference = model.logits(hidden[-1:])
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _port()
    ranks = [context.Process(target=_rank, args=(rank, port, head, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        got = dict(results.get(timeout=240) for _ in ranks)
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.terminate()
    for rank in range(2):
        assert got[rank]["tokens"] == expected, f"rank {rank}"
        assert got[rank]["ranks_equal"]  # every rank holds the same bits: each decides alike
        assert got[rank]["kv_heads"] == 1  # its KV cache holds its own heads only
        # the layers' products split in two; norms and embedding are replicated, the LM head too or
        # split in two over the vocabulary
        whole_head = parameter_bytes(model.lm_head)
        assert got[rank]["head_bytes"] == (whole_head if head == "replicated" else whole_head // 2)
        assert got[rank]["layer_bytes"] * 2 == _layer_bytes(single)
        replicated = parameter_bytes(model) - _layer_bytes(single) - whole_head
        assert got[rank]["bytes"] == replicated + _layer_bytes(single) // 2 + got[rank]["head_bytes"]
        # what docs/deploy.md's table computes for larger models, here against the loaded ranks
        assert sum(rank_bytes(single.config, 2, 0, 4, head)[:2]) == got[rank]["bytes"]
    # the row-parallel sums round differently from one product: close, not the same bits
    torch.testing.assert_close(torch.tensor(got[0]["logits"]), reference, rtol=1e-4, atol=1e-4)
