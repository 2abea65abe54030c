"""The whole TokenSwift iteration on the device: no value read back inside it.

The host loop of decoding.py reads the accepted tokens after every verify (`.tolist()`), builds
the trie in Python and walks it node by node; on a GPU that is several blocking reads and ~100
small launches per iteration. Here one iteration is a fixed sequence of tensor operations over
buffers at fixed addresses, so on CUDA it is captured once as a graph and replayed:

  propose   the draft layers' logits at the last accepted node (kept from the last commit)
            -> per depth the top candidates, ranked with the target's noise;
  trie      the static tree's slots filled from the candidates, then k n-gram branches read from
            a device table [V, k, 3] (`DeviceNgramTable`); duplicate paths are de-duplicated
            into their first slot (`TrieSlots.assemble`), the rest masked out;
  verify    one fixed-shape forward of every slot (static_step.fixed_shape_forward), the LM head's
            pass over every slot (the target's logits);
  accept    every slot's sample (position-keyed noise, per-slot penalty windows), then the
            acceptance walk as tensor algebra (`walk`): a slot is on the accepted chain when it
            and each of its ancestors is the target's sample at its parent;
  commit    KV compaction of the chain into the committed slots, token history, the draft layers'
            logits at the last accepted slot (the next propose's), the n-gram table's new grams,
            the committed count, the EOS / max-length flag.

The host learns what an iteration committed from one small report copied asynchronously into
pinned memory, read one iteration late (the next iteration is already queued): the overlap
pattern of SGLang's overlap worker and TensorRT-LLM's overlap scheduler. An iteration queued after
the one that finished is a no-op (the done flag zeroes its commit). On a CPU the same code runs
eagerly; its tokens equal the host loop's, token for token (tests/decode/test_device_loop.py).

Scope: drafting from the verify pass with a static tree (`--draft-source verify --tree 3,3,3`);
the n-gram table starts from the prompt's exact top-k per start token (`DeviceNgramTable.add_all`)
and then keeps k continuations by the Space-Saving rule (a new gram replaces the least counted one
and takes its count + 1), which can differ from the host table's exact top-k: drafts only decide
how much is accepted, never what is sampled. Each phase above runs under a profiler label
(`device_loop.<phase>`), which `scripts/gpu_iteration_profile.py` reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from tokenswift_trt.decode.stages import DecodeState
from tokenswift_trt.decode.static_step import bucket_for, compiled_forward, fixed_shape_forward
from tokenswift_trt.decode.tree import StaticTree
from tokenswift_trt.model.decoder import ALIGNED_MAX_LEVELS
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, position_gumbel_tensor

GRAM = 4  # n-gram length: a start token and 3 continuation tokens


class DeviceNgramTable:
    """Per start token, k continuations [3] with counts, on the device: ids [V, k, 3], counts [V, k]."""

    def __init__(self, vocab: int, k: int, device: torch.device) -> None:
        self.k = k
        self.ids = torch.zeros(vocab, k, GRAM - 1, dtype=torch.long, device=device)
        self.counts = torch.zeros(vocab, k, dtype=torch.long, device=device)

    def add(self, gram: torch.Tensor, valid: torch.Tensor) -> None:
        """gram [4] int64, valid 0-d bool: count the gram where valid (no value read back)."""
        start, continuation = gram[:1], gram[1:]  # [1], [3]
        row_ids, row_counts = self.ids[start][0], self.counts[start][0]  # [k, 3], [k]
        match = (row_ids == continuation).all(-1) & (row_counts > 0)  # [k]
        # Space-Saving: a new gram replaces the least counted entry (an empty one first) with its count + 1
        slot = torch.where(match.any(), match.long().argmax(), row_counts.argmin()).reshape(1)
        old_count, old_ids = row_counts[slot], row_ids[slot]  # [1], [1, 3]
        self.counts.index_put_((start, slot), torch.where(valid, old_count + 1, old_count))
        self.ids.index_put_((start, slot), torch.where(valid, continuation[None], old_ids))

    def add_all(self, tokens: torch.Tensor) -> None:
        """Fill an empty table from every gram of tokens [L] at once (the setup before the loop): each
        start token's k most counted grams with their exact counts, ties to the earlier first
        occurrence, most counted in slot 0. A handful of device ops for any L: adding the grams one by
        one takes ~10 launches each, seconds at a 100K-token prompt on an H200."""
        if bool(self.counts.any()):
            raise ValueError("add_all fills an empty n-gram table; later grams go through add")
        count = tokens.numel() - GRAM + 1
        if count <= 0:
            return
        grams = tokens.unfold(0, GRAM, 1)  # [n, 4]
        unique, inverse, counts = torch.unique(grams, dim=0, return_inverse=True, return_counts=True)
        order = torch.arange(count, device=tokens.device)
        first = torch.full((unique.shape[0],), count, dtype=torch.long, device=tokens.device)
        first.scatter_reduce_(0, inverse, order, reduce="amin")  # [u] each gram's first position
        # rank by (start, count descending, first occurrence): stable sorts, least significant key first
        rank = first.argsort(stable=True)
        rank = rank[(-counts[rank]).argsort(stable=True)]
        rank = rank[unique[rank, 0].argsort(stable=True)]
        starts = unique[rank, 0]  # [u] sorted
        place = torch.arange(starts.numel(), device=tokens.device) - torch.searchsorted(starts, starts)
        kept = place < self.k  # the k best of each start token
        rows, slots = starts[kept], place[kept]
        self.ids[rows, slots] = unique[rank[kept], 1:]
        self.counts[rows, slots] = counts[rank[kept]]

    def top(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """start 0-d -> (continuations [k, 3] most counted first, valid [k] bool)."""
        counts = self.counts[start.reshape(1)][0]  # [k]
        order = counts.argsort(descending=True, stable=True)
        return self.ids[start.reshape(1)][0][order], counts[order] > 0


@dataclass
class Trie:
    """One iteration's trie in fixed slots (S of them); dead slots are duplicates, empty n-gram
    branches and padding."""

    tokens: torch.Tensor  # [S] int64
    depths: torch.Tensor  # [S] int64
    parents: torch.Tensor  # [S] int64: canonical parent slot (0 for the root and dead slots)
    live: torch.Tensor  # [S] bool
    mask: torch.Tensor  # [S, S] bool: a live slot sees itself and its live ancestors
    paths: torch.Tensor  # [S, Dmax] each slot's tokens after the root, -1 past its depth


class TrieSlots:
    """The fixed slot layout: slot 0 the root, then the static tree's nodes (breadth first), then k
    n-gram branches of 3 slots each (root -> g1 -> g2 -> g3), then padding to `size`."""

    def __init__(self, tree: StaticTree, ngram_topk: int, size: int, device: torch.device) -> None:
        tree_nodes = tree.num_nodes
        parents = tree.parents.tolist()
        depths = tree.depths.tolist()
        for _ in range(ngram_topk):
            for step in range(GRAM - 1):
                parents.append(0 if step == 0 else len(parents) - 1)
                depths.append(step + 1)
        used = len(parents)
        if size < used:
            raise ValueError(f"{used} trie slots do not fit in {size}")
        parents += [-1] * (size - used)
        depths += [0] * (size - used)
        self.size, self.tree_nodes, self.used = size, tree_nodes, used
        self.max_depth = max(depths)
        self.width = max(tree.branching)
        # static tree node i takes candidate `ranks[i]` of depth `depths[i]`: a flat index into [D, width]
        self.candidate_index = torch.tensor(
            [(d - 1) * self.width + r for d, r in zip(tree.depths.tolist()[1:], tree.ranks.tolist()[1:])],
            dtype=torch.long,
            device=device,
        )
        # ancestors[i, d - 1]: the slot at depth d on slot i's path (-1 past its depth)
        ancestors = [[-1] * self.max_depth for _ in range(size)]
        for slot in range(1, used):
            node = slot
            while node > 0:
                ancestors[slot][depths[node] - 1] = node
                node = parents[node]
        self.ancestors = torch.tensor(ancestors, dtype=torch.long, device=device)  # [S, Dmax]
        self.depths = torch.tensor(depths, dtype=torch.long, device=device)  # [S]
        self.parents = torch.tensor(parents, dtype=torch.long, device=device).clamp(min=0)  # [S]
        self.arange = torch.arange(size, device=device)

    def assemble(
        self, root: torch.Tensor, ranked: torch.Tensor, grams: torch.Tensor, gram_valid: torch.Tensor
    ) -> Trie:
        """root 0-d, ranked [D, width] candidate ids, grams [k, 3], gram_valid [k] -> the trie."""
        size = self.size
        tokens = torch.cat(
            (
                root[None],
                ranked.reshape(-1)[self.candidate_index],
                grams.reshape(-1),
                root.new_zeros(size - self.used),
            )
        )  # [S]
        valid = torch.cat(
            (
                torch.ones(self.tree_nodes, dtype=torch.bool, device=root.device),
                gram_valid.repeat_interleave(GRAM - 1),
                torch.zeros(size - self.used, dtype=torch.bool, device=root.device),
            )
        )  # [S]
        known = self.ancestors >= 0
        paths = torch.where(known, tokens[self.ancestors.clamp(min=0)], -1)  # [S, Dmax]
        same = (paths[:, None, :] == paths[None, :, :]).all(-1) & valid[None, :]  # [S, S]
        first = same.long().argmax(dim=1)  # the first valid slot with the same path
        canonical = torch.where(valid, first, self.arange)
        live = valid & (canonical == self.arange)
        chain = torch.where(known, canonical[self.ancestors.clamp(min=0)], 0)  # [S, Dmax]
        mask = torch.zeros(size, size, dtype=torch.bool, device=root.device)
        mask.scatter_(1, chain, known)  # slot 0 (root) may receive a False from an unknown entry
        mask[:, 0].fill_(True)  # a fill: `= True` copies a host value, refused in a graph capture
        mask |= torch.eye(size, dtype=torch.bool, device=root.device)
        return Trie(tokens, self.depths, canonical[self.parents], live, mask, paths)


@dataclass
class Walk:
    """The acceptance walk's outcome, all on the device."""

    chain: torch.Tensor  # [Dmax + 1] slots of the accepted chain by depth (root first; 0 past its end)
    emitted: torch.Tensor  # [Dmax + 1] the target's samples along the chain (accepted tokens, then bonus)
    count: torch.Tensor  # 0-d: tokens committed (emitted[:count])
    last: torch.Tensor  # 0-d: the slot whose sample is the bonus token
    stopped: torch.Tensor  # 0-d bool: an EOS token or the limit ends the generation


def walk(
    trie: Trie,
    samples: torch.Tensor,  # [S] the target's sample at every slot
    remaining: torch.Tensor,  # 0-d tokens left before the limit (>= 1)
    stop_ids: torch.Tensor,  # [E] stop token ids (may be empty)
    max_depth: int,
) -> Walk:
    """Lossless acceptance without a loop: a live slot is accepted when its token is the target's
    sample at its parent and its parent is accepted. De-duplicated, a parent has at most one live
    child per token, so the accepted slots form one chain from the root."""
    matched = trie.live & (trie.tokens == samples[trie.parents])
    matched[0].fill_(True)  # not `= True`: that copies a host scalar, refused during graph capture
    accepted = trie.live & ~(trie.mask & ~matched[None, :]).any(dim=-1)  # [S]: every ancestor matched
    last = torch.where(accepted, trie.depths, -1).argmax().reshape(1)  # 1-d indices: no read-back
    levels = torch.arange(max_depth + 1, device=samples.device)
    on_chain = trie.mask[last] & (trie.depths[None, :] == levels[:, None])  # [Dmax + 1, S]
    chain = on_chain.long().argmax(dim=1)
    emitted = samples[chain]
    length = trie.depths[last][0]
    is_stop = torch.isin(emitted, stop_ids) & (levels <= length)
    first_stop = torch.where(is_stop, levels, max_depth + 1).min()
    cut = torch.minimum(torch.minimum(length, remaining - 1), first_stop)
    bonus = chain[cut.clamp(min=0).reshape(1)][0]
    return Walk(chain, emitted, cut + 1, bonus, (first_stop <= cut) | (remaining <= cut + 1))


@dataclass
class Report:
    """What one iteration tells the host (read one iteration late)."""

    tokens: list[int]
    accepted: int  # draft tokens accepted
    ngram_accepted: int  # of those, on slots only an n-gram branch proposed
    done: bool


class DeviceLoop:
    """One sequence's iterations on the device after its prefill; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        state: DecodeState,
        tree: StaticTree,
        ngram_topk: int,
        last_hidden: torch.Tensor,  # [hidden] of the last committed token
        capture: bool,
        compiled: bool = False,  # the verify forward through torch.compile (static_step.compiled_forward)
    ) -> None:
        device = engine.device
        self.engine, self.state, self.tree = engine, state, tree
        self.depth = tree.depth
        used = tree.num_nodes + ngram_topk * (GRAM - 1)
        self.slots = TrieSlots(tree, ngram_topk, bucket_for(used) if capture else used, device)
        self.columns = torch.arange(state.full.capacity, device=device)
        self.forward = compiled_forward() if compiled else fixed_shape_forward
        self.vocab = engine.config.vocab_size
        self.index = torch.arange(self.vocab, dtype=torch.long, device=device)
        self.levels = torch.arange(self.slots.max_depth + 1, device=device)
        # position-aligned attention where the model has it on and every slot is shallower than 64 levels
        shallow = self.slots.max_depth < ALIGNED_MAX_LEVELS
        self.aligned = engine.model.torch_model.aligned_attention and shallow
        self.gram_offsets = torch.arange(-GRAM, 0, device=device)  # a gram ending before `stop`
        self.stop_ids = torch.tensor(sorted(state.stop_tokens), dtype=torch.long, device=device)
        self.limit = state.limit
        sampling = state.sampling
        self.window = sampling.penalty_window if sampling.penalty > 1 else 0
        self.window_offsets = torch.arange(-self.window, 0, device=device)  # the window before `count`
        self.exclusion = state.ngram_exclusion
        keyed = isinstance(state.random, PositionKeyedRandom)
        if not sampling.greedy and not keyed:
            raise ValueError("the device loop samples with position-keyed noise (PositionKeyedRandom)")
        self.seed = None if sampling.greedy else state.random.seed  # type: ignore[union-attr]
        # device state
        self.count = torch.tensor(len(state.tokens), dtype=torch.long, device=device)  # committed tokens
        self.done = torch.zeros((), dtype=torch.bool, device=device)
        model, layers = engine.model, engine.draft_layers
        root = state.history[len(state.tokens) - 1 : len(state.tokens)]  # [1]: the root follows last_hidden
        self.draft_logits = model.draft_logits(last_hidden[None], layers, self.depth, root)[:, 0]  # [D, V]
        self.table = DeviceNgramTable(self.vocab, ngram_topk, device) if ngram_topk > 0 else None
        if self.table is not None:
            end = len(state.tokens) - self.exclusion  # grams ending before the penalty window
            self.table.add_all(state.history[: max(end, 0)])
        self.report = torch.zeros(self.slots.max_depth + 5, dtype=torch.long, device=device)
        self.capture = capture and device.type == "cuda"
        # one captured iteration per attention route (`LlamaModel.cascade_route`), chosen by the host
        # from the committed length it has read (one iteration late: a few tokens behind)
        self.graphs: dict[bool | None, object] = {}
        # one memory pool for them: they never run at once and write only buffers made outside them
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.known_count = len(state.tokens)
        self.replays = 0

    # ------------------------------------------------------------ the iteration (no reads)

    def _noise(self) -> torch.Tensor | None:
        """[Dmax + 1, V] Gumbel noise of positions count .. count + Dmax (depth d samples count + d)."""
        if self.seed is None:
            return None
        return position_gumbel_tensor(self.seed, self.count + self.levels, self.index)

    def _windows(self, paths: torch.Tensor | None, depths: torch.Tensor | None) -> torch.Tensor:
        """Penalty windows: the committed window [W] (paths None), or per slot [S, W]: the last W
        of committed + the slot's path (shorter contexts padded with the first token, which is
        then in the window anyway, so the padding is inert)."""
        history = self.state.history
        if self.window == 0:
            return history[:0]
        committed = history[(self.count + self.window_offsets).clamp(min=0)]  # [W]
        if paths is None or depths is None:
            return committed
        rows = torch.cat((committed.expand(paths.shape[0], -1), paths.clamp(min=0)), dim=1)  # [S, W + Dmax]
        columns = depths[:, None] + (self.window_offsets + self.window)[None, :]
        return rows.gather(1, columns)

    def step(self, route: bool | None = None) -> None:
        """One iteration on the device state (eager, or recorded into a graph); `route`: the verify's
        attention route (`LlamaModel.cascade_route`, None: by the cache's capacity)."""
        engine, state, slots = self.engine, self.state, self.slots
        sampler = state.sampler
        count, history = self.count, state.history
        root = history[(count - 1).reshape(1)][0]
        with record_function("device_loop.propose"):
            noise = self._noise()
            # the kept draft logits, ranked with the noise the target will sample with
            ranked = sampler.rank(
                self.draft_logits,
                self._windows(None, None),
                None if noise is None else noise[: self.depth],
                slots.width,
            )  # [D, width]
        with record_function("device_loop.trie"):
            if self.table is not None:
                grams, gram_valid = self.table.top(root)
            else:
                grams = root.new_zeros(0, GRAM - 1)
                gram_valid = torch.zeros(0, dtype=torch.bool, device=root.device)
            trie = slots.assemble(root, ranked, grams, gram_valid)
        length = count - 1  # the root is not cached yet
        with record_function("device_loop.verify"):
            out = self.forward(
                engine.model.torch_model,
                state.full,
                trie.tokens,
                length + trie.depths,
                trie.mask,
                length,
                self.columns,
                route,
                self.aligned,
            )
        with record_function("device_loop.heads"):  # the target's; the drafts only at the last slot (commit)
            target_logits = engine.model.logits(out.hidden)  # [S, V]
        with record_function("device_loop.accept"):
            windows = self._windows(trie.paths, trie.depths)
            samples = sampler.sample_rows(
                target_logits, windows, None if noise is None else noise[trie.depths]
            )  # [S]
            result = walk(trie, samples, self.limit - count, self.stop_ids, slots.max_depth)
            committed = torch.where(self.done, 0, result.count)
        with record_function("device_loop.commit"):
            self._commit(out.hidden, samples, result, committed)

    def _commit(
        self,
        hidden: torch.Tensor,  # [S, H] the verify's hidden states
        samples: torch.Tensor,  # [S] every slot's sample
        result: Walk,
        committed: torch.Tensor,  # 0-d: tokens this iteration commits (0 once done)
    ) -> None:
        """The chain's K/V into the committed slots, history, draft logits, grams, flags."""
        engine, state, slots = self.engine, self.state, self.slots
        count, history = self.count, state.history
        length = count - 1
        source, target = length + result.chain, length + self.levels
        for cache_tensor in (state.full.keys, state.full.values):
            cache_tensor.index_copy_(2, target, cache_tensor.index_select(2, source))
        history.index_copy_(0, count + self.levels, result.emitted)
        last = result.last.reshape(1)
        with record_function("device_loop.drafts"):  # the draft layers at the last accepted slot only
            chosen, root = hidden.index_select(0, last), samples.index_select(0, last)  # [1, H], [1]
            # root-conditioned layers read the new root, the last slot's sample; others ignore it
            drafts = engine.model.draft_logits(chosen, engine.draft_layers, self.depth, root)  # [D, 1, V]
            self.draft_logits.copy_(drafts[:, 0])
        accepted = committed - 1
        from_ngrams = (
            (result.chain >= slots.tree_nodes) & (self.levels >= 1) & (self.levels <= accepted)
        ).sum()
        new_count = count + committed
        if self.table is not None:
            with record_function("device_loop.ngrams"):
                for offset in range(slots.max_depth + 1):
                    stop = count - self.exclusion + 1 + offset  # exclusive end of the gram
                    gram = history[(stop + self.gram_offsets).clamp(min=0)]
                    self.table.add(gram, (offset < committed) & (stop >= GRAM))
        self.report.copy_(
            torch.cat(
                (
                    result.emitted,
                    torch.stack(
                        (committed, accepted.clamp(min=0), from_ngrams, (self.done | result.stopped).long())
                    ),
                )
            )
        )
        self.count.copy_(new_count)
        self.done.copy_(self.done | result.stopped)

    # ------------------------------------------------------------ the host side

    @property
    def route(self) -> bool | None:
        """The attention route for the committed length the host knows."""
        return self.engine.model.torch_model.cascade_route(self.slots.size, self.known_count)

    def launch(self) -> None:
        """Queue one iteration: a graph replay on CUDA (each route's captured at its first call), else
        eager."""
        route = self.route
        if not self.capture:
            self.step(route)
            return
        if route not in self.graphs:
            self.graphs[route] = self._capture(route)
        self.graphs[route].replay()  # type: ignore[attr-defined]
        self.replays += 1

    def _capture(self, route: bool | None) -> object:
        # The warm-up outside the graph (allocator, kernel choice) must not change the sequence:
        # what it writes to read state is put back. Its cache and history writes land past the
        # committed `count`, which the real iteration rewrites before reading, so those (the KV
        # cache is most of the GPU's memory) need no copy.
        written = [self.count, self.done, self.draft_logits]
        if self.table is not None:
            written += [self.table.ids, self.table.counts]
        saved = [tensor.clone() for tensor in written]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(route)
        torch.cuda.current_stream().wait_stream(side)
        for tensor, before in zip(written, saved):
            tensor.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # records the iteration without running it
            self.step(route)
        return graph


def read_report(values: list[int], max_depth: int) -> Report:
    emitted, (count, accepted, ngram_accepted, done) = values[: max_depth + 1], values[max_depth + 1 :]
    return Report(emitted[:count], accepted, ngram_accepted, bool(done))


DeviceSteps = Generator[Report, None, None]


def run_device_loop(loop: DeviceLoop, timer: Callable[[str, float], None]) -> DeviceSteps:
    """Queue iterations and yield each one's report, one iteration late (the next one is queued
    before the host waits for the last). `timer(phase, seconds)` gets the host's own time per
    iteration ("host") and its waits ("wait")."""
    device = loop.report.device
    on_cuda = device.type == "cuda"
    buffers = [torch.zeros_like(loop.report, device="cpu", pin_memory=on_cuda) for _ in range(2)]
    events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
    previous: int | None = None
    turn = 0
    while True:
        tick = time.perf_counter()
        loop.launch()
        buffers[turn].copy_(loop.report, non_blocking=on_cuda)
        event = events[turn]
        if event is not None:
            event.record()
        timer("host", time.perf_counter() - tick)
        if previous is not None:
            tick = time.perf_counter()
            waiting = events[previous]
            if waiting is not None:
                waiting.synchronize()
            report = read_report(buffers[previous].tolist(), loop.slots.max_depth)
            loop.known_count += len(report.tokens)
            timer("wait", time.perf_counter() - tick)
            yield report
            if report.done:  # the iteration queued after it commits nothing
                return
        previous, turn = turn, 1 - turn
