"""`NodeTargets` on a CPU trie too large to sample in one batch: a visit samples its node and the
deepest path below it in one LM-head pass, and every sample is the one a visit of that node alone
gives."""

import pytest
import torch

from tokenswift_trt.decode.stages import BATCHED_NODES_MAX, CHAIN_ROWS, DecodeState, NodeTargets, accept_trie
from tokenswift_trt.decode.tree import Trie
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import PositionKeyedRandom, SamplingConfig, TorchSampler


def _state(engine, sampling: SamplingConfig) -> DecodeState:
    tokens = list(range(10, 30))
    history = torch.zeros(256, dtype=torch.long)
    history[: len(tokens)] = torch.tensor(tokens)
    return DecodeState(
        tokens=tokens,
        history=history,
        prompt_length=len(tokens),
        limit=256,
        full=KVCache(1, 1, 4, 256),
        partial=None,
        table=None,
        random=PositionKeyedRandom(5),
        sampling=sampling,
        stop_tokens=frozenset(),
        sampler=TorchSampler(sampling),
    )


def _trie(root: int, vocab: int) -> Trie:
    """Three short branches and a 30-token chain (a long match's branch) sharing its first node."""
    generator = torch.Generator().manual_seed(8)
    trie = Trie(root)
    chain = torch.randint(0, vocab, (30,), generator=generator).tolist()
    trie.add_path(chain, from_tree=False)
    for _ in range(3):
        trie.add_path(torch.randint(0, vocab, (3,), generator=generator).tolist(), from_tree=True)
    trie.add_path([chain[0], chain[1] + 1], from_tree=True)  # a sibling off the chain
    return trie


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.0),
        SamplingConfig(temperature=1.0, min_p=0.05, penalty=1.2, penalty_window=8),
    ],
    ids=["greedy", "seeded"],
)
def test_chained_visits_sample_what_single_visits_do(llama_engine64, sampling):
    engine = llama_engine64
    state = _state(engine, sampling)
    trie = _trie(state.tokens[-1], engine.config.vocab_size)
    assert len(trie) > BATCHED_NODES_MAX  # not one batch: visits
    hidden = torch.randn(len(trie), engine.config.hidden_size, dtype=torch.float64)

    calls: list[int] = []
    target_logits = engine.model.target_logits

    def counted(rows, *args, **kwargs):
        calls.append(rows.shape[0])
        return target_logits(rows, *args, **kwargs)

    chained = NodeTargets(engine, state, trie, hidden)
    single = NodeTargets(engine, state, trie, hidden)
    single.chain_rows = 1
    assert chained.chain_rows == CHAIN_ROWS > 1
    engine.model.target_logits = counted
    try:
        chained_samples = [chained.sample(node) for node in range(len(trie))]
        chain_calls, calls[:] = list(calls), []
        single_samples = [single.sample(node) for node in range(len(trie))]
    finally:
        del engine.model.target_logits
    assert chained_samples == single_samples
    assert calls == [1] * len(trie)
    assert len(chain_calls) < len(trie) and max(chain_calls) == CHAIN_ROWS  # whole runs of the chain

    # a chain the target follows 12 deep (each node's token its parent's sample), beside short
    # branches: the walk accepts it whole, and chained visits accept what single visits do
    rows = torch.randn(64, engine.config.hidden_size, dtype=torch.float64)
    followed = Trie(state.tokens[-1])
    for _ in range(12):
        last = NodeTargets(engine, state, followed, rows[: len(followed)])
        last.chain_rows = 1
        followed.add_path(followed.tokens[1:] + [last.sample(len(followed) - 1)], from_tree=False)
    for branch in ([1, 2], [3], [4, 5, 6]):
        followed.add_path(branch, from_tree=True)
    hidden = rows[: len(followed)]
    one = NodeTargets(engine, state, followed, hidden)
    each = NodeTargets(engine, state, followed, hidden)
    each.chain_rows = 1
    walked = accept_trie(followed, one, 100, frozenset())
    assert walked == accept_trie(followed, each, 100, frozenset())
    assert len(walked.nodes) == 12
