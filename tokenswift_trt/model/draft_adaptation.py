"""Online adaptation of the draft layers to the text being generated.

Over a long generation the text drifts away from what the draft layers were trained on and their
acceptance decays (on SmolLM2-135M from 0.41 in the first 1K tokens to 0.34 in the fourth,
docs/smollm2.md). Verification already computes everything a training step needs at every committed
position p: the target's final hidden state h_p (the verify pass's row of the root or of an accepted
node) and the token x[p + 1] sampled there. A `DraftAdapter` keeps the newest committed positions
and, every `block` of them, takes one optimiser step over the newest `span` of them on its own copy
of the draft layers with the "sampled" loss of `train-heads` (training/train_heads.py): layer i at
position p, reading h_p and the root x[p + 1], is scored by cross-entropy against the target's
processed distribution of x[p + 1 + i] (the contextual penalty over that position's window, then
temperature, top-k/p, min-p, η, as sampling applies them; within the draft vocabulary when the
layers have one), its own logits penalised over the same window. Greedy decoding's processed
distribution is the committed token itself. Only positions already committed are read (strictly
causal), and drafts decide only how many tokens an iteration accepts, never which: output is
unchanged.

Each request adapts its own copy (`DraftAdapter.layers`, what its drafting reads); the engine's
layers, shared by every request of a server, are never written. The LM head, the draft vocabulary's
head and the embedding stay shared and frozen. A path input (`PathInput`) is not adapted.

Layers with a draft vocabulary (the K tokens most frequent in their training text) cannot draft a
token outside it, and a long generation leaves it: on SmolLM2-135M under the paper's sampling, from
5% of the sampled tokens in the first 2K to 19% (one seed) and 64% (another) in the last 2K
(docs/smollm2.md). With `vocab="request"` (the default) the adapted copy drafts over the draft
vocabulary plus every token the request has used, its prompt and what it commits, through the LM
head's own rows of them (`RequestVocabHead`): the step's loss covers them as well, and the set grows
at each step, a fixed point of the loop, so drafts stay deterministic.

Both loops adapt: the host loop hands each iteration's rows to `observe` as it commits; the device
loop (decode/device_loop.py) keeps them on the device and hands them over once the host has read the
iteration, and the request's own head rows fill buffers in place, so graphs captured over them stay
valid until a full buffer is replaced. `observe` and `admit` read no device value back, so the
device loop's queue keeps running. On CUDA the step runs on a side stream: it is launched after an
iteration's commit and trains a float32 master copy while the iterations of the next block draft and
verify with the layers as they were; the next step's launch makes the main stream wait for it and
copies the master into the drafting copy (one block late, at a fixed point of the loop, so drafts
do not depend on timing; replayed on SmolLM2 the lag costs layer 1 at most 0.0015 of acceptance,
docs/bench/adapt-replay-smollm2-lag). CUDA's backward of the penalty's gather adds with atomics, so
steps may differ in their last bits from run to run: that moves acceptance, never the output. On a
CPU the step runs in place and the changed products are re-packed for the CPU kernels
(linear.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenswift_trt.kernels.config import KernelConfig
from tokenswift_trt.model.config import ModelConfig
from tokenswift_trt.model.draft_layers import DraftLayers, VocabHead, draft_layout
from tokenswift_trt.model.linear import Linear, pack_linears
from tokenswift_trt.model.sampling import SamplingConfig, apply_penalty, process_logits

SCOPES = ("all", "layer1")  # every draft-layer parameter / layer 1 and the root input only
OPTIMIZERS = ("adam", "sgd")
VOCABS = ("request", "draft")  # the draft vocabulary plus the request's own tokens / the draft vocabulary
DEFAULT_LR = {"adam": 3e-4, "sgd": 3e-2}


@dataclass(frozen=True)
class AdaptationSettings:
    """How a request adapts its draft layers (the defaults are what the offline replay measured)."""

    block: int = 16  # committed positions per optimiser step (one step per block)
    span: int = 16  # each step trains on the newest `span` committed positions (at least the block's)
    scope: str = "all"  # SCOPES
    optimizer: str = "adam"  # OPTIMIZERS
    lr: float | None = None  # None: DEFAULT_LR of the optimiser
    vocab: str = "request"  # VOCABS: what the adapted copy drafts over (layers with a draft vocabulary)
    beta2: float = 0.999  # Adam's second-moment decay (docs/bench/adapt-replay-smollm2-beta2)
    steps: int = 1  # optimiser steps per block, each over the same positions
    warmup: int = 0  # steps over which the learning rate rises linearly to `lr` (0: from the first)

    def validate(self) -> None:
        """Raise ValueError naming the bad value."""
        if self.block < 1:
            raise ValueError(
                f"the adaptation block (--adapt-block) must be at least 1 position, got {self.block}"
            )
        if self.span < 1:
            raise ValueError(
                f"the adaptation span (--adapt-span) must be at least 1 position, got {self.span}"
            )
        if self.scope not in SCOPES:
            raise ValueError(
                f"the adaptation scope (--adapt-scope) must be one of {', '.join(SCOPES)}, got {self.scope!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"the adaptation optimiser (--adapt-optimizer) must be one of {', '.join(OPTIMIZERS)}, "
                f"got {self.optimizer!r}"
            )
        if self.vocab not in VOCABS:
            raise ValueError(
                f"the adaptation vocabulary (--adapt-vocab) must be one of {', '.join(VOCABS)}, "
                f"got {self.vocab!r}"
            )
        if not 0 < self.beta2 < 1:
            raise ValueError(f"Adam's beta2 for adaptation must be in (0, 1), got {self.beta2}")
        if self.steps < 1:
            raise ValueError(f"the adaptation must take at least 1 step per block, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"the adaptation warmup must be at least 0 steps, got {self.warmup}")
        if self.lr is not None and not 0 < self.lr < 1:
            raise ValueError(f"the adaptation learning rate (--adapt-lr) must be in (0, 1), got {self.lr}")

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def copy_draft_layers(layers: DraftLayers, config: ModelConfig, dtype: torch.dtype) -> DraftLayers:
    """A trainable copy of `layers` (normal tensors, not inference tensors) in `dtype` on their
    device; the vocabulary head (frozen rows of the LM head) is shared, not copied."""
    state = layers.state_dict()
    layout = draft_layout(state)
    device = next(layers.parameters()).device
    with torch.inference_mode(False):
        copy = DraftLayers(
            config,
            layout.num_layers,
            layout.root_conditioned,
            layout.vocab_size,
            layout.root_width,
            layout.path_width,
        ).to(device=device, dtype=dtype)
        copy.load_state_dict({key: value.clone() for key, value in state.items()})
    copy.vocab_head = layers.vocab_head
    return copy.eval()


OWN_CHUNK = 512  # the request's own rows are held in buffers of a multiple of this many


@dataclass(frozen=True)
class RequestVocabHead:
    """The draft vocabulary's head (`VocabHead`, shared by every request) and one request's own: the
    LM head's rows of the tokens it has used outside that vocabulary, in buffers of fixed capacity C
    that fill in place (a drafting graph captured over them stays valid until they are replaced).
    states [..., hidden] -> logits [..., V], -inf outside both."""

    shared: VocabHead
    ids: torch.Tensor  # [C] the own tokens' ids (unused slots: 0)
    linear: Linear  # [C, hidden] their rows of the LM head (unused slots: zero rows)
    mask: torch.Tensor  # [C] 0 for a used slot, -inf for an unused one

    @classmethod
    def empty(cls, shared: VocabHead, capacity: int, head: torch.Tensor) -> RequestVocabHead:
        """An own part with room for `capacity` tokens (a multiple of OWN_CHUNK) and none used."""
        capacity = -(-max(capacity, 1) // OWN_CHUNK) * OWN_CHUNK
        device, dtype = head.device, head.dtype
        linear = Linear(head.shape[1], capacity, bias=False, device="meta", dtype=dtype)  # no random init
        linear.weight = nn.Parameter(torch.zeros(capacity, head.shape[1], device=device, dtype=dtype), False)
        ids = torch.zeros(capacity, dtype=torch.long, device=device)
        return cls(shared, ids, linear, torch.full((capacity,), -torch.inf, device=device))

    def fill(self, start: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Slots start .. start + n - 1 take ids [n] and their rows [n, hidden] (in place)."""
        end = start + ids.shape[0]
        with torch.no_grad():
            self.ids[start:end] = ids
            self.linear.weight[start:end] = rows
            self.mask[start:end] = 0
        self.linear.pack(half=True)  # float16 where the tiled kernel applies, as `VocabHead`'s rows

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        logits = self.shared(states)  # [..., V]
        own = (self.linear(states).float() + self.mask).to(logits.dtype)  # [..., C]
        # a used slot's column is -inf in `logits` (outside the draft vocabulary); an unused slot's
        # -inf leaves its column as it is
        return logits.scatter_reduce_(-1, self.ids.expand(own.shape), own, "amax")


class DraftAdapter:
    """One request's draft layers and their online adaptation (module docstring)."""

    def __init__(
        self,
        layers: DraftLayers,
        config: ModelConfig,
        embedding: torch.Tensor,  # [V, hidden] input embedding (frozen)
        head: torch.Tensor,  # [V, hidden] LM head weight (frozen)
        final_norm: nn.Module,  # the target's final norm (its head reads norm(h))
        history: torch.Tensor,  # [capacity] the request's committed ids (DecodeState.history)
        sampling: SamplingConfig,
        settings: AdaptationSettings = AdaptationSettings(),
        kernels: KernelConfig = KernelConfig(),
    ) -> None:
        settings.validate()
        self.settings, self.sampling, self.kernels = settings, sampling, kernels
        self.history, self.final_norm = history, final_norm
        device = head.device
        self.layers = copy_draft_layers(layers, config, layers.layers[0].linear.weight.dtype)
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        on_host_in_place = (
            self.side_stream is None and self.layers.layers[0].linear.weight.dtype == torch.float32
        )
        # the parameters the optimiser changes: the drafting copy itself on a float32 CPU engine, else
        # a float32 master copied into it after each step (CPU) or at the next step's launch (CUDA)
        self.master = self.layers if on_host_in_place else copy_draft_layers(layers, config, torch.float32)
        self.count = len(self.master) if settings.scope == "all" else 1
        trained: list[nn.Module] = list(self.master.layers[: self.count])
        if self.master.root is not None:
            trained.append(self.master.root)
        with torch.inference_mode(False):
            for parameter in self.master.parameters():
                parameter.requires_grad_(False)
            parameters = [p for module in trained for p in module.parameters()]
            for parameter in parameters:
                parameter.requires_grad_(True)
            if settings.optimizer == "adam":
                self.optimizer = torch.optim.Adam(
                    parameters, lr=settings.learning_rate, betas=(0.9, settings.beta2)
                )
            else:
                self.optimizer = torch.optim.SGD(parameters, lr=settings.learning_rate)
        # the products the step changes, re-packed for the CPU kernels after it
        self.repacked = [
            module
            for module in (*self.layers.layers[: self.count], self.layers.root)
            if module is not None
            for module in module.modules()
            if isinstance(module, Linear)
        ]
        if device.type == "cpu":
            pack_linears(self.layers, half=True, kernels=kernels)
        vocab = layers.vocab
        self.head = head
        # the request's own tokens outside the draft vocabulary: how many were admitted
        self.grows = settings.vocab == "request" and vocab is not None and layers.vocab_head is not None
        self.own = 0
        self.known: set[int] = set() if vocab is None else set(vocab.tolist())  # what drafts can propose
        self.head_version = 0  # bumped whenever the drafting copy's head is replaced (not filled)
        with torch.inference_mode(False):
            self.rows = (head if vocab is None else head[vocab.to(device)]).detach().float()  # [K, hidden]
            self.embedding = embedding.detach()
            size = head.shape[0]
            # token id -> column of `rows` (rows.shape[0]: outside them)
            self.column_of = torch.full((size + 1,), self.rows.shape[0], dtype=torch.long, device=device)
            known = torch.arange(self.rows.shape[0], device=device)
            self.column_of[known if vocab is None else vocab.to(device)] = known
        self.positions: list[int] = []  # committed positions p held, ascending
        self.tokens: list[int] = []  # committed tokens not admitted yet (`admit`, at the next step)
        self.hidden: list[torch.Tensor] = []  # their h_p rows, [n, hidden] float32 chunks
        self.pending = 0  # positions held that no step has trained on yet
        self.updates = 0
        self.in_flight: torch.cuda.Event | None = None

    def observe(self, first_position: int, hidden: torch.Tensor, tokens: Sequence[int]) -> float:
        """The committed positions first_position .. first_position + n - 1, the target's hidden
        states there, hidden [n, hidden] (pre-norm), and the tokens committed after them, tokens [n]
        (x[p + 1], already in `history`); takes a step when a block has filled. Positions that do not
        follow the last ones held (AR steps in between) start the held rows afresh: a step never pairs
        rows across a gap. Returns the host seconds spent."""
        started = time.perf_counter()
        if self.positions and first_position != self.positions[-1] + 1:
            self.positions, self.hidden, self.pending = [], [], 0
        with torch.inference_mode(False):
            self.hidden.append(hidden.detach().float().clone())  # [n, hidden]
        self.positions.extend(range(first_position, first_position + hidden.shape[0]))
        self.tokens.extend(tokens)
        self.pending += hidden.shape[0]
        if self.pending >= self.settings.block:
            self._update()
        return time.perf_counter() - started

    def admit(self, tokens: Sequence[int]) -> None:
        """Token ids the request has used (its prompt, committed tokens): the adapted copy drafts them
        too from now on (`vocab="request"`; nothing otherwise). Read on the host: no device sync.
        Never while a step is in flight: the step reads the rows and columns this changes."""
        assert self.in_flight is None, "admit before a step's launch, after the step before is published"
        if not self.grows:
            return
        new = sorted(set(tokens) - self.known)
        if not new:
            return
        self.known.update(new)
        device = self.rows.device
        ids = torch.tensor(new, dtype=torch.long)  # [m]
        if device.type == "cuda":  # a pinned copy goes without waiting for the queued iterations
            ids = ids.pin_memory()
        ids = ids.to(device, non_blocking=True)
        size = self.rows.shape[0]
        used, self.own = self.own, self.own + len(new)
        head = self.layers.vocab_head
        with torch.inference_mode(False), torch.no_grad():
            self.rows = torch.cat((self.rows, self.head[ids].float()))  # [K + E, hidden]
            self.column_of.masked_fill_(self.column_of == size, self.rows.shape[0])
            self.column_of[ids] = torch.arange(size, self.rows.shape[0], device=device)
            if not isinstance(head, RequestVocabHead) or self.own > head.ids.shape[0]:
                shared = head.shared if isinstance(head, RequestVocabHead) else head
                grown = RequestVocabHead.empty(shared, 2 * self.own, self.head)
                if used:
                    grown.fill(0, head.ids[:used], head.linear.weight[:used])
                self.layers.vocab_head, head = grown, grown
                self.head_version += 1
            head.fill(used, ids, self.head[ids])

    def finish(self) -> None:
        """Wait for a step still running on the side stream (before the request's memory goes) and
        draft with its result from now on."""
        self._publish()

    def _publish(self) -> None:
        """CUDA: the main stream waits for the step in flight, then drafts with its result."""
        if self.in_flight is None:
            return
        torch.cuda.current_stream().wait_event(self.in_flight)
        self.in_flight = None
        self._copy_master()

    def _update(self) -> None:
        """One optimiser step on the newest `span` positions, at least the pending ones (and the
        `count` before them that deeper layers' targets reach back over). CUDA: the step before it,
        launched a block ago, is published first, and nothing the side stream reads changes before."""
        self._publish()
        train = max(self.pending, self.settings.span)
        hidden = torch.cat(self.hidden)[-(train + self.count) :]  # [N, hidden]
        keep = hidden.shape[0]
        first = self.positions[-keep]  # held positions are consecutive (`observe`)
        positions = torch.arange(first, first + keep, device=hidden.device)  # [N]
        roots = self.history[positions + 1]  # [N]: x[p + 1], what each row's root input reads
        self.admit(self.tokens)
        self.tokens = []
        windows = self._windows(positions, self.positions[-1])  # [N, W] window columns, or None
        pending = min(train, keep)  # rows whose distributions are targets, the newest
        hold = self.settings.span + self.count  # what the next step reads of these
        self.hidden, self.positions, self.pending = [hidden[-hold:]], self.positions[-hold:], 0
        self.updates += 1
        if self.side_stream is None:
            self._step(hidden, roots, windows, pending)
            if self.master is self.layers:
                for linear in self.repacked:
                    linear.pack(half=True, kernels=self.kernels)
            else:
                self._copy_master()
            return
        ready = torch.cuda.Event()
        ready.record()
        self.side_stream.wait_event(ready)
        for tensor in (hidden, roots) + (() if windows is None else (windows,)):
            tensor.record_stream(self.side_stream)
        with torch.cuda.stream(self.side_stream):
            self._step(hidden, roots, windows, pending)
            self.in_flight = torch.cuda.Event()
            self.in_flight.record(self.side_stream)

    def _copy_master(self) -> None:
        with torch.no_grad():
            for live, master in zip(self.layers.parameters(), self.master.parameters()):
                live.copy_(master)

    def _windows(self, positions: torch.Tensor, newest: int) -> torch.Tensor | None:
        """positions [N] -> [N, W]: the columns of the penalty window in force when x[p + 1] was
        sampled (ids at p + 1 - W .. p; rows near the start repeat their first id), or None
        without a penalty; `newest`: the last position (on the host)."""
        size = self.sampling.penalty_window
        if self.sampling.penalty == 1 or size == 0:
            return None
        width = min(size, newest + 1)
        offsets = torch.arange(width, device=positions.device) - (width - 1)  # [W]: -(W - 1) .. 0
        index = positions[:, None] + offsets  # [N, W]
        first = (positions - (size - 1)).clamp_(min=0)[:, None]  # a row's first position in its window
        ids = self.history[torch.maximum(index, first)]
        return self.column_of[ids]

    def _teacher(
        self, hidden: torch.Tensor, windows: torch.Tensor | None, tokens: torch.Tensor
    ) -> torch.Tensor:
        """hidden [R, hidden], windows [R, W] or None, tokens [R] (what was sampled) -> the target's
        processed distribution over the rows' columns [R, K]; greedy: the token's one-hot (0 rows
        for tokens outside the draft vocabulary)."""
        columns = self.column_of[tokens]
        size = self.rows.shape[0]
        if self.sampling.greedy:
            inside = columns < size
            return F.one_hot(columns.clamp(max=size - 1), size).float() * inside[:, None]
        normed = self.final_norm(hidden.to(self.final_norm.weight.dtype)).float()
        logits = _penalised(F.linear(normed, self.rows), windows, self.sampling.penalty)
        scores = process_logits(
            logits, logits.new_empty(0, dtype=torch.long), replace(self.sampling, penalty=1.0)
        )
        return F.softmax(scores, dim=-1)

    def _step(
        self, hidden: torch.Tensor, roots: torch.Tensor, windows: torch.Tensor | None, pending: int
    ) -> None:
        rows = hidden.shape[0]
        with torch.inference_mode(False), torch.enable_grad():
            hidden, roots = hidden.clone(), roots.clone()
            windows = None if windows is None else windows.clone()
            first = max(1, rows - pending)  # the oldest row whose distribution is a target
            with torch.no_grad():
                teacher = self._teacher(
                    hidden[first:], None if windows is None else windows[first:], roots[first:]
                )  # [R, K]: row t is the target's distribution of x[t + 1] (row `first` first)
            embedding = None
            if self.master.root is not None:
                embedding = self.embedding[roots].float()  # [N, hidden]
            for _ in range(self.settings.steps):
                self._descend(hidden, embedding, windows, teacher, first)

    def _descend(
        self,
        hidden: torch.Tensor,  # [N, hidden]
        embedding: torch.Tensor | None,  # [N, hidden] the roots' embeddings
        windows: torch.Tensor | None,  # [N, W]
        teacher: torch.Tensor,  # [R, K] the target's distributions of rows first + 1 ..
        first: int,
    ) -> None:
        """One optimiser step of the layers' loss against `teacher` (within _step's grad mode)."""
        rows = hidden.shape[0]
        chain = self.master.chain(hidden, self.count, embedding)
        losses = []
        for depth, (_, normed) in enumerate(chain, start=1):
            # layer `depth` at row j drafts x[j + 1 + depth]: row j + depth's distribution
            start = max(0, first - depth)
            student = F.linear(normed[start : rows - depth], self.rows)  # [R', K]
            target = teacher[start + depth - first :]
            if windows is not None:
                student = _penalised(student, windows[start + depth :], self.sampling.penalty)
            if target.shape[0]:
                losses.append(-(target * F.log_softmax(student, dim=-1)).sum(-1).mean())
        if not losses:
            return
        self.optimizer.zero_grad(set_to_none=True)
        torch.stack(losses).mean().backward()
        if self.settings.warmup:
            scale = min(1.0, self.updates / self.settings.warmup)
            for group in self.optimizer.param_groups:
                group["lr"] = self.settings.learning_rate * scale
        self.optimizer.step()


def _penalised(logits: torch.Tensor, windows: torch.Tensor | None, theta: float) -> torch.Tensor:
    """logits [R, K] with the contextual penalty over each row's window columns windows [R, W]
    (column K, a token outside the rows, penalises nothing); differentiable."""
    if windows is None or theta == 1:
        return logits
    padded = torch.cat((logits, logits.new_zeros(logits.shape[0], 1)), dim=1)  # [R, K + 1]
    return apply_penalty(padded, windows, theta)[:, :-1]
