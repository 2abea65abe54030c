"""A request's state, checked and allocated: `new_decode_state` (caches, n-gram table, long-match
index, buffers, within the memory budget), the draft adapter over its own copy of the draft layers
(`new_adapter`), and the drafting state's catch-up (`refresh_drafting_state`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenswift_trt.decode.admission import AdmissionError, admit, available_bytes, plan_memory
from tokenswift_trt.decode.autotune import probe_plan
from tokenswift_trt.decode.config import GenerationConfig, GenerationError, MemoryAdmissionError
from tokenswift_trt.decode.ngram import NGRAM_LENGTH, NgramTable
from tokenswift_trt.decode.stages import DecodeState
from tokenswift_trt.decode.static_step import StaticForward, bucket_for
from tokenswift_trt.decode.suffix import MAX_DEPTH as SUFFIX_MAX_DEPTH
from tokenswift_trt.decode.suffix import SuffixIndex
from tokenswift_trt.decode.tree import build_static_tree
from tokenswift_trt.model.draft_adaptation import AdaptationSettings, DraftAdapter
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.kv_cache import KVCache, PartialKVCache
from tokenswift_trt.model.sampling import RandomSource, SamplingConfig, TorchSampler, fused_sampler
from tokenswift_trt.model.tensor_parallel import VocabParallelHead


def _check_request(engine: Engine, prompt: Sequence[int], config: GenerationConfig) -> int:
    """The request's checks, its settings' and its prompt's against the engine; returns its maximum
    length (prompt + generated)."""
    config.validate()
    if not prompt:
        raise GenerationError("the prompt is empty: give at least one token")
    vocab = engine.config.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise GenerationError(f"prompt token ids must be in [0, {vocab})")
    max_length = config.max_length or engine.config.max_position_embeddings
    if len(prompt) >= max_length:
        raise GenerationError(
            f"the prompt has {len(prompt)} tokens but the engine's maximum length is {max_length}: "
            "shorten the prompt"
        )
    return max_length


def new_adapter(engine: Engine, state: DecodeState, config: GenerationConfig) -> DraftAdapter:
    """A `DraftAdapter` over a copy of the engine's draft layers, reading the request's history."""
    return engine_adapter(engine, state.history, len(state.tokens), config.sampling, config.adaptation)


def engine_adapter(
    engine: Engine,
    history: torch.Tensor,  # [capacity] ids: the prompt, then what is committed
    used: int,  # ids of `history` already there (the prompt's): drafted from the start
    sampling: SamplingConfig,
    settings: AdaptationSettings,
) -> DraftAdapter:
    """A `DraftAdapter` over a copy of the engine's draft layers and its frozen LM head, embedding and
    final norm, reading `history`."""
    model = engine.model.torch_model
    if isinstance(model.lm_head, VocabParallelHead):  # the adapter's loss reads every row of the head
        raise GenerationError(
            "draft adaptation needs the whole LM head on every rank: drop --adapt-drafts, or run --tp "
            "with the replicated head"
        )
    adapter = DraftAdapter(
        engine.draft_layers,
        engine.config,
        model.model.embed_tokens.weight,
        model.lm_head.weight,
        model.model.norm,
        history,
        sampling,
        settings,
        engine.kernels,
    )
    adapter.admit(history[:used].tolist())
    return adapter


def new_decode_state(
    engine: Engine, prompt: Sequence[int], config: GenerationConfig, random: RandomSource
) -> DecodeState:
    """Check the request and allocate everything the sequence needs (caches, n-gram table, buffers)."""
    max_length = _check_request(engine, prompt, config)
    drafting = config.method == "tokenswift"
    from_verify = config.resolved_draft_source == "verify"
    auto = config.tree.auto
    probe_tree, probe_topk = probe_plan(config.resolved_draft_source, engine.device)
    tree = build_static_tree((probe_tree if auto else config.tree).branching)
    max_depth = len(engine.draft_layers) + (0 if from_verify else 1)
    if drafting and tree.depth > max_depth:
        raise GenerationError(
            f"tree '{config.tree}' is {tree.depth} deep but the engine has {len(engine.draft_layers)} "
            "draft layers "
            f"(at most {max_depth} levels when drafting from the {config.resolved_draft_source} pass)"
        )
    ngram_topk = (probe_topk if auto else config.ngram_topk) if drafting else 0
    limit = min(len(prompt) + config.max_new_tokens, max_length)
    # long matches (suffix.py) wherever n-grams are reused: a branch is offered only where the text's
    # last 8+ tokens occurred before, which a penalty makes rarer but does not rule out
    long_matches = ngram_topk > 0
    max_trie = (
        tree.num_nodes + ngram_topk * tree.branching[0] * NGRAM_LENGTH + long_matches * SUFFIX_MAX_DEPTH
    )
    cfg, dtype, device = engine.config, engine.dtype, engine.device
    static = config.static_steps if config.static_steps is not None else device.type == "cuda"
    static = static or config.compile_steps
    if config.compile_steps and not engine.model.fixed_shape_steps:
        raise GenerationError("--compile-steps compiles PyTorch engines: drop it for this engine")
    static = static and engine.model.fixed_shape_steps  # exported graphs (onnx, TensorRT) have their own
    max_trie = bucket_for(max_trie) if static else max_trie  # slots a padded forward writes
    with_partial = drafting and not from_verify
    plan = plan_memory(engine, limit + max_trie, config.kv_budget if with_partial else 0, max_trie)
    try:
        admit(plan, config.memory_budget if config.memory_budget is not None else available_bytes(device))
    except AdmissionError as error:
        if plan.tree_bytes > plan.full_cache_bytes + plan.partial_cache_bytes:
            tree_name = "auto's probe tree" if auto else f"tree '{config.tree}'"
            fix = "a larger memory budget" if auto else "a smaller tree or n-gram top-k, or the tree auto"
            raise MemoryAdmissionError(
                f"{error}; most of it is the tree buffers ({max_trie:,} nodes: {tree_name} and "
                f"{ngram_topk} n-gram branches): give {fix}"
            ) from None
        raise MemoryAdmissionError(str(error)) from None
    full = KVCache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, limit + max_trie, dtype, device, engine.kernels
    )
    partial = (
        PartialKVCache(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            config.kv_budget,
            recent=config.kv_recent,
            dtype=dtype,
            device=device,
            longest=limit,
        )
        if with_partial
        else None
    )
    history = torch.zeros(limit + max_trie, dtype=torch.long, device=device)
    history[: len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
    compiled = config.compile_steps
    static_full = (
        StaticForward(engine.model.torch_model, full, capture=device.type == "cuda", compiled=compiled)
        if static
        else None
    )
    return DecodeState(
        tokens=list(prompt),
        history=history,
        prompt_length=len(prompt),
        limit=limit,
        full=full,
        partial=partial,
        table=NgramTable(NGRAM_LENGTH) if ngram_topk > 0 else None,
        random=random,
        sampling=config.sampling,
        stop_tokens=frozenset() if config.ignore_eos else frozenset(cfg.eos_token_ids),
        sampler=fused_sampler(config.sampling, device, dtype, engine.kernels)
        or TorchSampler(config.sampling),
        ngram_exclusion=config.sampling.penalty_window if config.sampling.penalty > 1 else 0,
        suffix=SuffixIndex() if long_matches else None,
        static_full=static_full,
        static_partial=StaticForward(
            engine.model.torch_model, partial, capture=static_full.capture, compiled=compiled
        )
        if static_full is not None and partial is not None
        else None,
        needed_bytes=plan.needed_bytes,
    )


def refresh_drafting_state(state: DecodeState) -> None:
    """Catch the drafting state up with what is committed: reselect the partial cache, count the new
    n-grams (after the prefill, and after AR steps that skipped their upkeep)."""
    if state.partial is not None:
        state.partial.select(state.full, state.queries)
    if state.table is not None:
        state.table.update(state.tokens, len(state.tokens) - state.ngram_exclusion)
