"""The device executor: the stages of stages.py run as one iteration with no value read back inside it.

The host loop (loop.py) reads the accepted tokens after every verify, builds the trie in Python and
walks it node by node; on a GPU that is several blocking reads and ~100 small launches per iteration.
Here an iteration is the stages' device forms over buffers at fixed addresses, so on CUDA it is
captured once per plan as a graph and replayed:

  propose   the draft layers' logits at the last accepted node (kept from the last commit), ranked
            with the target's noise and penalty window (`DecodeState.slot_windows`);
  trie      the static tree's slots filled from the candidates, then k n-gram branches from the
            device table (`ngram.NgramTensors`, the host table's exact counts and order) and a long
            match's branch (`suffix.match_tensors`, over the history), duplicate paths
            de-duplicated into their first slot (`tree.TrieSlots.assemble`);
  verify    one fixed-shape forward of every slot (static_step.fixed_shape_forward) and the LM head;
  accept    every slot's sample (position-keyed noise, per-slot penalty windows), then the acceptance
            walk as tensor algebra (`stages.accept_slots`);
  commit    the chain's K/V and tokens (`stages.commit_chain`), the draft layers' logits at the last
            accepted slot (the next propose's), the n-gram table's new grams, the committed count,
            the EOS / limit flag; with draft adaptation, the chain's hidden states into a ring of
            rows by position (`committed_hidden`), which the host hands to the request's
            `DraftAdapter` once it has read the iteration (its step runs on a side stream on CUDA).

A `DeviceLoop` holds one sequence's device state (committed count, draft logits, n-gram table); a
`DevicePlan` is one plan's iteration (tree, n-gram k: its slot layout, report, and captured graphs,
one per attention route). `--tree auto` switches between plans and plain AR steps as the tuner says
(loop.py): `enter` takes the host's state on, `leave` hands it back. The host learns what an
iteration committed from a small report copied asynchronously into pinned memory and read one
iteration late (the next iteration is already queued): the overlap pattern of SGLang's overlap
worker and TensorRT-LLM's overlap scheduler. An iteration queued after the one that finished is a
no-op (the done flag zeroes its commit); one queued before the host stopped a plan is read and
committed (`Report.drained`). On a CPU the same code runs eagerly (tests/decode/test_executors.py
compares it with the host loop). Each phase runs under a profiler label (`device_loop.<phase>`),
which `tools/gpu_iteration_profile.py` reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from tokenswift_trt.decode.ngram import NGRAM_LENGTH, NgramTensors
from tokenswift_trt.decode.stages import SUFFIX_MIN_MATCH, DecodeState, Walk, accept_slots, commit_chain
from tokenswift_trt.decode.static_step import bucket_for, compiled_forward, fixed_shape_forward
from tokenswift_trt.decode.suffix import MAX_DEPTH as SUFFIX_MAX_DEPTH
from tokenswift_trt.decode.suffix import match_tensors
from tokenswift_trt.decode.tree import StaticTree, Trie, TrieSlots
from tokenswift_trt.model.decoder import ALIGNED_MAX_LEVELS
from tokenswift_trt.model.draft_adaptation import DraftAdapter
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, position_gumbel_tensor

KEPT_ROWS = 256  # hidden-state rows kept for draft adaptation: two iterations of the deepest chain


@dataclass
class Report:
    """What one iteration tells the host (read one iteration late)."""

    tokens: list[int]
    accepted: int  # draft tokens accepted
    ngram_accepted: int  # of those, on slots only an n-gram branch proposed
    done: bool
    offered: int  # the deepest live slot: the longest draft offered
    chain: list[int]  # the accepted slots by depth, root excluded
    ngram_ranks: list[int]  # per slot, `TrieTensors.ngram_ranks`
    drained: bool = False  # queued before the host stopped its plan: committed, not reported to the tuner


@dataclass
class DevicePlan:
    """One plan's iteration: a static tree and n-gram k in a fixed slot layout (sized to a bucket
    when captured), its report buffer and its graphs, one per attention route."""

    tree: StaticTree
    ngram_topk: int
    slots: TrieSlots
    report: torch.Tensor  # [2 (Dmax + 1) + 5 + S] int64
    levels: torch.Tensor  # [Dmax + 1]
    graphs: dict[bool | None, object] = field(default_factory=dict)

    def read(self, values: list[int], drained: bool = False) -> Report:
        width = self.slots.max_depth + 1
        emitted, chain = values[:width], values[width : 2 * width]
        count, accepted, ngram_accepted, done, offered = values[2 * width : 2 * width + 5]
        ranks = values[2 * width + 5 :]
        return Report(
            emitted[:count], accepted, ngram_accepted, bool(done), offered, chain[1:count], ranks, drained
        )

    def features(self, report: Report) -> Trie:
        """What the tuner reads of the iteration's trie (`TrieSlots.features`)."""
        return self.slots.features(report.ngram_ranks)


class DeviceLoop:
    """One sequence's iterations on the device after its prefill; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        state: DecodeState,
        depth: int,  # draft rows kept between iterations: the deepest plan's
        ngram_topk: int,  # grams kept per start token: the largest plan's k
        capture: bool,
        compiled: bool = False,  # the verify forward through torch.compile (static_step.compiled_forward)
        adapter: DraftAdapter | None = None,  # the request's adapted draft layers (engine.draft_layers)
    ) -> None:
        device = engine.device
        self.engine, self.state, self.depth, self.ngram_topk = engine, state, depth, ngram_topk
        # long matches (suffix.py) where the host loop would offer them: plans with n-gram branches
        self.long_depth = SUFFIX_MAX_DEPTH if state.suffix is not None else 0
        self.columns = torch.arange(state.full.capacity, device=device)
        self.forward = compiled_forward() if compiled else fixed_shape_forward
        self.vocab = engine.config.vocab_size
        self.index = torch.arange(self.vocab, dtype=torch.long, device=device)
        self.stop_ids = torch.tensor(sorted(state.stop_tokens), dtype=torch.long, device=device)
        sampling = state.sampling
        keyed = isinstance(state.random, PositionKeyedRandom)
        if not sampling.greedy and not keyed:
            raise ValueError("the device loop samples with position-keyed noise (PositionKeyedRandom)")
        self.seed = None if sampling.greedy else state.random.seed  # type: ignore[union-attr]
        self.exclusion = state.ngram_exclusion
        # device state: set from the host's by `enter`
        self.count = torch.zeros((), dtype=torch.long, device=device)  # committed tokens
        self.done = torch.zeros((), dtype=torch.bool, device=device)
        self.draft_logits: torch.Tensor | None = None  # [D, V], made by the first `enter`
        self.last_hidden: torch.Tensor | None = None  # [hidden]
        self.table = NgramTensors(self.vocab, ngram_topk, state.history) if ngram_topk > 0 else None
        self.capture = capture and device.type == "cuda"
        self.bucketed = capture
        self.plans: dict[tuple[tuple[int, ...], int], DevicePlan] = {}
        # one memory pool for every graph: they never run at once and write only buffers made outside them
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.known_count = len(state.tokens)  # committed tokens the host has read
        # draft adaptation: the committed positions' hidden states, row p % KEPT_ROWS for position p
        # (an iteration writes its chain's rows; the host gathers them once it has read the report)
        self.adapter = adapter
        self.kept: torch.Tensor | None = None  # [KEPT_ROWS, hidden]
        if adapter is not None:
            hidden = engine.config.hidden_size
            self.kept = torch.zeros(KEPT_ROWS, hidden, dtype=engine.dtype, device=device)
        self.head_version = -1  # the adapter's head version the graphs were captured over
        self.replays = 0
        self.captured = 0
        self.halted = False

    # ------------------------------------------------------------ host <-> device state

    def enter(self, last_hidden: torch.Tensor) -> None:
        """Take the host's state on: its committed tokens, the draft layers' logits after
        last_hidden [hidden] (the last committed token's), its grams (`NgramTensors.update`)."""
        state, engine = self.state, self.engine
        count = len(state.tokens)
        self.count.fill_(count)
        self.done.fill_(False)
        self.known_count, self.halted = count, False
        root = state.history[count - 1 : count]  # [1]: the root follows last_hidden
        drafts = engine.model.draft_logits(last_hidden[None], engine.draft_layers, self.depth, root)[:, 0]
        if self.draft_logits is None or self.last_hidden is None:  # fixed addresses from here on
            self.draft_logits, self.last_hidden = drafts.clone(), last_hidden.clone()
        else:
            self.draft_logits.copy_(drafts)
            self.last_hidden.copy_(last_hidden)
        if self.table is not None:
            self.table.update(count - self.exclusion)

    def leave(self) -> torch.Tensor:
        """Hand the state back to the host once the last queued iteration was read: the committed
        slots of the cache, the grams counted; returns the last committed token's hidden [hidden]."""
        count = len(self.state.tokens)
        self.state.full.length = count - 1  # the root is not cached
        if self.table is not None:
            self.table.counted_until = max(self.table.counted_until, count - self.exclusion + 1)
        assert self.last_hidden is not None, "leave follows enter"
        return self.last_hidden.clone()

    def plan(self, tree: StaticTree, ngram_topk: int) -> DevicePlan:
        """The plan's iteration (built once per plan)."""
        key = (tree.branching, ngram_topk)
        if key not in self.plans:
            if tree.depth > self.depth or ngram_topk > self.ngram_topk:
                raise ValueError(f"tree {tree.branching} k={ngram_topk} is larger than the device loop's")
            long_depth = self.long_depth if ngram_topk > 0 else 0
            used = tree.num_nodes + ngram_topk * (NGRAM_LENGTH - 1) + long_depth
            device = self.engine.device
            size = bucket_for(used) if self.bucketed else used
            slots = TrieSlots(tree, ngram_topk, size, device, long_depth)
            # an iteration in flight writes rows up to max_depth + 1 past those the host gathers
            assert 2 * (slots.max_depth + 1) <= KEPT_ROWS, "deeper chains than the kept rows hold"
            report = torch.zeros(2 * (slots.max_depth + 1) + 5 + slots.size, dtype=torch.long, device=device)
            levels = torch.arange(slots.max_depth + 1, device=device)
            self.plans[key] = DevicePlan(tree, ngram_topk, slots, report, levels)
        return self.plans[key]

    @property
    def captures(self) -> int:
        """Graphs captured so far (those captured again after a head replacement count again)."""
        return self.captured

    # ------------------------------------------------------------ the iteration (no reads)

    def step(self, plan: DevicePlan, route: bool | None = None) -> None:
        """One iteration of `plan` on the device state (eager, or recorded into a graph); `route`: the
        verify's attention route (`LlamaModel.cascade_route`, None: by the cache's capacity)."""
        engine, state, slots = self.engine, self.state, plan.slots
        count, history = self.count, state.history
        assert self.draft_logits is not None, "step follows enter"
        root = history[(count - 1).reshape(1)][0]
        with record_function("device_loop.propose"):
            # [Dmax + 1, V] Gumbel noise of positions count .. count + Dmax (depth d samples count + d)
            noise = (
                None
                if self.seed is None
                else position_gumbel_tensor(self.seed, count + plan.levels, self.index)
            )
            ranked = state.sampler.rank(
                self.draft_logits[: plan.tree.depth],
                state.slot_windows(count),
                None if noise is None else noise[: plan.tree.depth],
                slots.width,
            )  # [D, width]
        with record_function("device_loop.trie"):
            if plan.ngram_topk > 0 and self.table is not None:
                grams, gram_valid = self.table.top(root)
                grams, gram_valid = grams[: plan.ngram_topk], gram_valid[: plan.ngram_topk]
            else:
                grams = root.new_zeros(0, NGRAM_LENGTH - 1)
                gram_valid = torch.zeros(0, dtype=torch.bool, device=root.device)
            long_tokens = long_valid = None
            if slots.long_depth:  # what followed the latest earlier occurrence of the text's end
                long_tokens, long_valid = match_tensors(
                    history, count, state.limit - count, min_match=SUFFIX_MIN_MATCH
                )
            trie = slots.assemble(root, ranked, grams, gram_valid, long_tokens, long_valid)
        length = count - 1  # the root is not cached yet
        # position-aligned attention where the model has it on and every slot is shallower than 64 levels
        aligned = engine.model.torch_model.aligned_attention and slots.max_depth < ALIGNED_MAX_LEVELS
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
                aligned,
            )
        with record_function("device_loop.heads"):  # the target's; the drafts only at the last slot (commit)
            target_logits = engine.model.logits(out.hidden)  # [S, V]
        with record_function("device_loop.accept"):
            windows = state.slot_windows(count, trie.paths, trie.depths)
            samples = state.sampler.sample_rows(
                target_logits, windows, None if noise is None else noise[trie.depths]
            )  # [S]
            result = accept_slots(trie, samples, state.limit - count, self.stop_ids, slots.max_depth)
            committed = torch.where(self.done, 0, result.count)
        with record_function("device_loop.commit"):
            offered = torch.where(trie.live, trie.depths, 0).max()
            self._commit(plan, out.hidden, samples, result, committed, trie.ngram_ranks, offered)

    def _commit(
        self,
        plan: DevicePlan,
        hidden: torch.Tensor,  # [S, H] the verify's hidden states
        samples: torch.Tensor,  # [S] every slot's sample
        result: Walk,
        committed: torch.Tensor,  # 0-d: tokens this iteration commits (0 once done)
        ngram_ranks: torch.Tensor,  # [S]
        offered: torch.Tensor,  # 0-d: the deepest live slot's depth
    ) -> None:
        """The chain's K/V and tokens, draft logits, grams, report, flags."""
        engine, count = self.engine, self.count
        assert self.draft_logits is not None and self.last_hidden is not None
        commit_chain(self.state, count, result)
        last = result.last.reshape(1)
        with record_function("device_loop.drafts"):  # the draft layers at the last accepted slot only
            chosen, root = hidden.index_select(0, last), samples.index_select(0, last)  # [1, H], [1]
            # root-conditioned layers read the new root, the last slot's sample; others ignore it
            drafts = engine.model.draft_logits(chosen, engine.draft_layers, self.depth, root)  # [D, 1, V]
            self.draft_logits.copy_(drafts[:, 0])
            self.last_hidden.copy_(chosen[0])
        accepted = committed - 1
        levels = plan.levels
        if self.kept is not None:  # the chain's hidden states (past `committed`: rows rewritten later)
            rows = (count - 1 + levels).remainder(KEPT_ROWS)  # [Dmax + 1]
            self.kept.index_copy_(0, rows, hidden.index_select(0, result.chain))
        from_ngrams = ((result.chain >= plan.slots.tree_nodes) & (levels >= 1) & (levels <= accepted)).sum()
        if self.table is not None:
            with record_function("device_loop.ngrams"):
                self.table.add_committed(count, committed, self.exclusion, levels.numel())
        flags = torch.stack(
            (committed, accepted.clamp(min=0), from_ngrams, (self.done | result.stopped).long(), offered)
        )
        plan.report.copy_(torch.cat((result.emitted, result.chain, flags, ngram_ranks)))
        self.count.copy_(count + committed)
        self.done.copy_(self.done | result.stopped)

    # ------------------------------------------------------------ the host side

    def committed_hidden(self, first_position: int, count: int) -> torch.Tensor:
        """The target's hidden states at committed positions first_position .. + count - 1 (an
        iteration the host has read), [count, hidden]: gathered in stream order, no read back."""
        assert self.kept is not None, "kept only for draft adaptation"
        rows = torch.arange(first_position, first_position + count, device=self.kept.device)
        return self.kept.index_select(0, rows.remainder(KEPT_ROWS))

    def _follow_head(self) -> None:
        """Graphs captured over a draft head the adapter has since replaced are captured again, into
        a new memory pool (the old one goes with the last graph that used it)."""
        if self.adapter is not None and self.adapter.head_version != self.head_version:
            if any(plan.graphs for plan in self.plans.values()):
                for plan in self.plans.values():
                    plan.graphs.clear()
                self.pool = torch.cuda.graph_pool_handle()
            self.head_version = self.adapter.head_version

    def route(self, plan: DevicePlan) -> bool | None:
        """The verify's attention route for the committed length the host knows."""
        return self.engine.model.torch_model.cascade_route(plan.slots.size, self.known_count)

    def prepare(self, plan: DevicePlan) -> None:
        """Capture the plan's graph for the current route now (on CUDA), if it has none yet."""
        self._follow_head()
        route = self.route(plan)
        if self.capture and route not in plan.graphs:
            plan.graphs[route] = self._capture(plan, route)

    def launch(self, plan: DevicePlan) -> None:
        """Queue one iteration: a graph replay on CUDA (each plan's and route's captured at its first
        call), else eager."""
        self._follow_head()
        route = self.route(plan)
        if not self.capture:
            self.step(plan, route)
            return
        if route not in plan.graphs:
            plan.graphs[route] = self._capture(plan, route)
        plan.graphs[route].replay()  # type: ignore[attr-defined]
        self.replays += 1

    def _capture(self, plan: DevicePlan, route: bool | None) -> object:
        # The warm-up outside the graph (allocator, kernel choice) must not change the sequence:
        # what it writes to read state is put back. Its cache and history writes land past the
        # committed `count`, which the real iteration rewrites before reading, so those (the KV
        # cache is most of the GPU's memory) need no copy.
        assert self.draft_logits is not None and self.last_hidden is not None
        written = [self.count, self.done, self.draft_logits, self.last_hidden]
        if self.table is not None:
            written += self.table.tensors()
        saved = [tensor.clone() for tensor in written]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(plan, route)
        torch.cuda.current_stream().wait_stream(side)
        for tensor, before in zip(written, saved):
            tensor.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # records the iteration without running it
            self.step(plan, route)
        self.captured += 1
        return graph

    def halt(self) -> None:
        """Queue no further iteration of the running plan (`run_device_loop` reads the one in flight)."""
        self.halted = True


DeviceSteps = Generator[Report, None, None]


def run_device_loop(loop: DeviceLoop, plan: DevicePlan, timer: Callable[[str, float], None]) -> DeviceSteps:
    """Queue iterations of `plan` and yield each one's report, one iteration late (the next one is
    queued before the host waits for the last), until one reports done, or after `loop.halt()` the
    one in flight was read. `timer(phase, seconds)` gets the host's own time per iteration ("host")
    and its waits ("wait")."""
    device = plan.report.device
    on_cuda = device.type == "cuda"
    buffers = [torch.zeros_like(plan.report, device="cpu", pin_memory=on_cuda) for _ in range(2)]
    events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
    previous: int | None = None
    turn = 0
    while True:
        queued = not loop.halted
        if queued:
            tick = time.perf_counter()
            loop.launch(plan)
            buffers[turn].copy_(plan.report, non_blocking=on_cuda)
            event = events[turn]
            if event is not None:
                event.record()
            timer("host", time.perf_counter() - tick)
        if previous is not None:
            tick = time.perf_counter()
            waiting = events[previous]
            if waiting is not None:
                waiting.synchronize()
            report = plan.read(buffers[previous].tolist(), drained=not queued)
            loop.known_count += len(report.tokens)
            timer("wait", time.perf_counter() - tick)
            yield report
            if report.done or not queued:  # an iteration queued after a done one commits nothing
                return
        elif not queued:
            return
        previous, turn = (turn, 1 - turn) if queued else (None, turn)
