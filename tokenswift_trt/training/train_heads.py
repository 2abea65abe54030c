"""Train the three chained draft layers with the base model frozen.

Loss: for draft layer i (1..3), the prediction lm_head(layer_i(h_t)) of the token i + 1 positions
after the base head's target, x[t + 1 + i], is scored by cross-entropy against
- "distill" (default): the frozen base model's own distribution for that token, softmax of its
  logits at t + i (self-distillation: acceptance asks the draft to agree with the target model,
  not with the corpus, and a full distribution teaches more per position than one token);
- "sampled": the same distribution after the sampling transforms that decoding applies
  (`teacher_penalty` over the `teacher_window` tokens before it, then min-p `teacher_min_p`,
  renormalised; within the draft vocabulary): under min-p 0.1 about a quarter of the raw softmax
  lies on tokens sampling never draws (SmolLM2 on its own text), and coupled verification accepts
  a draft exactly when it is the token sampling draws;
- "coupled": one minus the probability that the draft's first candidate is the token sampling draws
  when both are ranked with the same Gumbel noise (`coupled_hit`: coupled verification's acceptance
  of a depth, in closed form), the "sampled" teacher against the student after the same penalty
  and min-p cut: acceptance itself, not a proxy for it (on SmolLM2 it matches "sampled" at layer 1
  and adds ~0.007 at layers 2 and 3, docs/smollm2.md);
- "tokens": the corpus token x[t + 1 + i] (the paper's objective);
the mean over layers is minimised. Root-conditioned layers (`root_conditioned`) also read, at t,
the embedding of x[t + 1]: the corpus token there, the target's own sample at inference.
A path input (`path_width`, runtime/draft_layers.PathInput) drafts x[t + 1 + d] for d = 2..3 from
depth d-1's state and the corpus token x[t + d] (the draft it follows at inference), scored the
same way as layer d; `path_only` trains it alone on top of frozen layers (--init-heads).
AdamW (0.9, 0.999), weight decay 0.1, linear warm-up then cosine decay, gradient accumulation.
The base forward runs without gradients; only the draft layers' parameters train.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tokenswift_trt.model.draft_layers import (
    HEADS_PREFIX,
    PATH_PREFIX,
    RELEASED_PREFIX,
    ROOT_PREFIX,
    VOCAB_KEY,
    DraftLayers,
    draft_key,
    draft_layout,
    heads_file_key,
    read_heads_file,
)
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.kv_cache import KVCache
from tokenswift_trt.model.sampling import SamplingConfig, min_p_filter
from tokenswift_trt.training.errors import TrainingError
from tokenswift_trt.training.ranks import Ranks

CHECKPOINT = "checkpoint.pt"
# settings a resumed run may change: how often it scores itself (not what it trains)
RESUMABLE = ("eval_every", "progress_sequences", "checkpoint_every")
HEADS_FILE = "heads.safetensors"
LOSSES = ("distill", "sampled", "coupled", "tokens")
COUPLED_SUPPORT = 64  # teacher tokens `coupled_hit` scores: min-p 0.1 keeps ~21 on SmolLM2 (at least 20)


@dataclass(frozen=True)
class TrainHeadsConfig:
    steps: int = 400
    seq_len: int = 2048
    batch: int = 1  # sequences per micro-batch
    grad_accum: int = 4
    lr: float = 5e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    checkpoint_every: int = 100
    eval_sequences: int = 8  # held-out sequences the finished layers are scored on
    eval_every: int = 0  # score the layers on `progress_sequences` held-out sequences every N steps; 0: never
    progress_sequences: int = 2
    seed: int = 0
    loss: str = "distill"  # see LOSSES and the module docstring
    # the "sampled" loss's transforms (the paper's sampling settings, W scaled to SmolLM2's runs)
    teacher_min_p: float = 0.1
    teacher_penalty: float = 1.2
    teacher_window: int = 256
    root_conditioned: bool = False  # layers that read the root token (model/draft_layers.py)
    root_width: int = 0  # > 0: the root input is an MLP this wide (implies root_conditioned)
    path_width: int = 0  # > 0: a path input this wide drafts depths >= 2 (root-conditioned layers only)
    path_only: bool = False  # train the path input alone; the other layers stay as --init-heads gave them
    draft_vocab: int = 16384  # the layers draft this many of the training text's most frequent tokens; 0: all
    # > 0: the base model's states of this many training sequences are computed once (float16, in
    # memory) and every batch is drawn from them; 0: fresh sequences, a base forward each
    state_cache: int = 0

    @property
    def teacher(self) -> SamplingConfig:
        """The "sampled" loss's transforms, as decoding takes them."""
        return SamplingConfig(
            min_p=self.teacher_min_p, penalty=self.teacher_penalty, penalty_window=self.teacher_window
        )

    def validate(self) -> None:
        if self.loss not in LOSSES:
            raise TrainingError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.eval_every < 0:
            raise TrainingError(f"eval every must be 0 (never) or a number of steps, got {self.eval_every}")
        for name in ("steps", "seq_len", "batch", "grad_accum", "checkpoint_every", "progress_sequences"):
            if getattr(self, name) <= 0:
                raise TrainingError(f"{name.replace('_', ' ')} must be positive, got {getattr(self, name)}")
        if self.root_width < 0:
            raise TrainingError(f"root input width must be 0 (linear) or positive, got {self.root_width}")
        if self.path_width < 0:
            raise TrainingError(f"path input width must be 0 (none) or positive, got {self.path_width}")
        if self.path_width and not (self.root_conditioned or self.root_width):
            raise TrainingError("a path input needs root-conditioned layers: add --root-width")
        if self.path_only and not self.path_width:
            raise TrainingError("--path-only trains a path input: give its width with --path-width")
        if self.state_cache < 0:
            raise TrainingError(
                f"state cache must be 0 (off) or a number of sequences, got {self.state_cache}"
            )
        if self.draft_vocab < 0:
            raise TrainingError(
                f"draft vocabulary size must be 0 (all tokens) or positive, got {self.draft_vocab}"
            )
        try:  # decoding's own checks of the same settings
            self.teacher.validate()
        except ValueError as error:
            raise TrainingError(f"the sampled loss's teacher: {error}") from None
        if self.seq_len < 8:
            raise TrainingError(f"sequence length must be at least 8, got {self.seq_len}")
        if not self.lr > 0:
            raise TrainingError(f"learning rate must be positive, got {self.lr}")


def lr_at(step: int, config: TrainHeadsConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 0 at `steps`."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def base_hidden(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """ids [T] -> the frozen base model's last hidden states [T, hidden] (pre-norm, float32).

    The copy is a normal tensor (not an inference tensor), usable as an autograd input.
    """
    c = engine.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, ids.numel(), engine.dtype, engine.device)
    hidden = engine.model(
        ids.to(engine.device), torch.arange(ids.numel(), device=engine.device), cache
    ).hidden
    return hidden.to(torch.float32, copy=True)


def head_weight(engine: Engine) -> torch.Tensor:
    """The shared, frozen lm_head weight [V, hidden] in float32 (draft layers train in float32)."""
    return engine.model.lm_head.weight.detach().to(torch.float32, copy=True)


def base_logits(engine: Engine, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [T, hidden] -> the base head's logits [T, V] through the float32 lm_head weight."""
    return F.linear(engine.model.model.norm(hidden), weight)


def root_embeddings(engine: Engine, draft_layers: DraftLayers, ids: torch.Tensor) -> torch.Tensor | None:
    """ids [T] -> the input embedding of x[t + 1] for every t [T, hidden] (float32; the last row
    repeats x[T - 1] and is never scored): what root-conditioned layers read at t; None for
    layers that read no root."""
    if not draft_layers.root_conditioned:
        return None
    roots = torch.cat((ids[1:], ids[-1:])).to(engine.device)
    with torch.no_grad():
        return engine.model.model.embed_tokens.weight[roots].to(torch.float32, copy=True)


def draft_logits(
    weight: torch.Tensor, draft_layers: DraftLayers, hidden: torch.Tensor, roots: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """hidden [T, hidden] -> per draft layer logits through the shared lm_head weight [V, hidden]
    (`roots` [T, hidden]: `root_embeddings`, for root-conditioned layers): [T, V], or [T, K] over the
    draft vocabulary's rows when the layers have one (what inference drafts from; `vocab_ids` maps
    the columns back to token ids). With SmolLM2's 49,152-token head and 8,192 ids this is most of a
    training step's arithmetic saved."""
    if draft_layers.vocab is not None:
        weight = weight.index_select(0, draft_layers.vocab.to(weight.device))  # [K, hidden]
    return [F.linear(state, weight) for state in draft_layers(hidden, None, roots)]


def vocab_ids(draft_layers: DraftLayers, columns: torch.Tensor) -> torch.Tensor:
    """Columns of `draft_logits` -> token ids (the identity without a draft vocabulary)."""
    return columns if draft_layers.vocab is None else draft_layers.vocab.to(columns.device)[columns]


def vocab_targets(draft_layers: DraftLayers, ids: torch.Tensor) -> torch.Tensor:
    """Token ids [N] -> columns of `draft_logits` [N]; ids outside the draft vocabulary -> -100
    (cross-entropy's ignore index: a token the layers can never draft teaches them nothing)."""
    if draft_layers.vocab is None:
        return ids
    vocab = draft_layers.vocab.to(ids.device)
    column = torch.searchsorted(vocab, ids).clamp_(max=vocab.numel() - 1)
    return torch.where(vocab[column] == ids, column, torch.full_like(ids, -100))


def shifted_embeddings(engine: Engine, ids: torch.Tensor, shift: int) -> torch.Tensor:
    """ids [T] -> the input embedding of x[t + shift] for every t [T, hidden] (float32; rows past the
    end repeat x[T - 1] and are never scored)."""
    tokens = torch.cat((ids[shift:], ids[-1:].expand(min(shift, ids.numel())))).to(engine.device)
    with torch.no_grad():
        return engine.model.model.embed_tokens.weight[tokens].to(torch.float32, copy=True)


def path_logits(
    engine: Engine,
    weight: torch.Tensor,
    draft_layers: DraftLayers,
    first_state: torch.Tensor,
    ids: torch.Tensor,
) -> list[torch.Tensor]:
    """The path input's drafts of depths 2..len(layers), teacher-forced: from layer 1's states
    first_state [T, hidden] (pre-norm) and the corpus tokens of the path, row t of depth d drafts
    x[t + 1 + d] (as layer d does) -> per depth logits [T, V] or [T, K] (draft vocabulary)."""
    assert draft_layers.path is not None
    if draft_layers.vocab is not None:
        weight = weight.index_select(0, draft_layers.vocab.to(weight.device))
    state, out = first_state, []
    for depth in range(2, len(draft_layers) + 1):
        state, normed = draft_layers.path(state, shifted_embeddings(engine, ids, depth))
        out.append(F.linear(normed, weight))
    return out


def window_mask(ids: torch.Tensor, vocab: torch.Tensor | None, columns: int, window: int) -> torch.Tensor:
    """ids [T] -> [T, columns] bool: row t marks the columns (token ids, or positions in the draft
    vocabulary `vocab` [columns]) of the tokens among ids[t + 1 - W : t + 1], decoding's penalty
    window when it samples x[t + 1]; tokens outside `vocab` mark nothing."""
    count = ids.shape[0]
    vocab_size = max(columns if vocab is None else int(vocab.max()) + 1, int(ids.max()) + 1)
    column = torch.full((vocab_size + 1,), columns, dtype=torch.long, device=ids.device)  # spare: columns
    known = torch.arange(columns, device=ids.device)
    column[known if vocab is None else vocab.to(ids.device)] = known
    padded = torch.cat((ids.new_full((window - 1,), vocab_size), ids))  # [W - 1 + T]
    windows = column[padded.unfold(0, window, 1)]  # [T, W]: row t holds ids[t + 1 - W .. t]
    mask = torch.zeros(count, columns + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, windows, True)[:, :columns]


def penalise(logits: torch.Tensor, mask: torch.Tensor | None, theta: float) -> torch.Tensor:
    """logits [T, K] with decoding's contextual penalty where `mask` [T, K] is set (positive / θ,
    negative × θ, each token once), differentiable: the same values as `sampling.apply_penalty`."""
    if mask is None or theta == 1:
        return logits
    return torch.where(mask, torch.where(logits > 0, logits / theta, logits * theta), logits)


def sampled_teacher(
    scores: torch.Tensor, ids: torch.Tensor, vocab: torch.Tensor | None, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores [T, K] (row t: the base's logits of x[t + 1], over the token ids `vocab` [K], or over
    the whole vocabulary when None), ids [T] -> ([T, K] the distribution sampling draws x[t + 1]
    from, [T, K] its rows' penalty windows or None when W is 0): each row's logits penalised (θ)
    for the tokens of its window (`window_mask`), then min-p (at least MIN_P_KEEP kept), then
    softmax; 0 where min-p drops a token. Within a draft vocabulary, min-p is relative to its best
    token. The windows serve the draft's logits too (decoding penalises both)."""
    windows = None
    if sampling.penalty_window > 0:
        windows = window_mask(ids.to(scores.device), vocab, scores.shape[1], sampling.penalty_window)
    cut = min_p_filter(penalise(scores.float(), windows, sampling.penalty), sampling.min_p)
    return F.softmax(cut, dim=-1), windows


def coupled_hit(teacher: torch.Tensor, student: torch.Tensor, support: int = COUPLED_SUPPORT) -> torch.Tensor:
    """teacher [N, V] probabilities (0 where sampling cannot draw), student [N, V] logits -> [N] the
    probability that argmax(log q + g) = argmax(log p + g) for one Gumbel draw g, q = softmax(student):
    how often a draft ranked with the target's own noise is the target's sample. For Gumbel-max
    (exponential races) P(both pick i) = 1 / Σ_j max(p_j / p_i, q_j / q_i); summed over the teacher's
    `support` most likely tokens (the rest of the vocabulary, p = 0 there, enters through q alone).
    Differentiable in the student."""
    p, index = teacher.float().topk(min(support, teacher.shape[-1]), dim=-1)  # [N, K]
    # -inf (tokens a min-p cut dropped from the draft) kept finite: their q is 0 to float precision
    log_q = F.log_softmax(student.float(), dim=-1).clamp_min(-1e4)  # [N, V]
    lq = log_q.gather(-1, index)  # [N, K]
    lp = p.clamp_min(1e-30).log()  # p = 0: ratios p_j / p_i vanish, and such an i never counts
    # log Σ_j over the K columns of max(p_j / p_i, q_j / q_i): [N, K(i)]
    ratios = torch.maximum(lp[:, None, :] - lp[:, :, None], lq[:, None, :] - lq[:, :, None])  # [N, K, K]
    inside = torch.logsumexp(ratios, dim=-1)
    rest = torch.log1p(-lq.exp().sum(-1).clamp(max=1 - 1e-6))  # log of q's mass beyond the K columns [N]
    denominator = torch.logaddexp(inside, rest[:, None] - lq)  # [N, K]
    return torch.where(p > 0, torch.exp(-denominator), 0.0).sum(-1)


def draft_loss(
    engine: Engine,
    weight: torch.Tensor,
    draft_layers: DraftLayers,
    ids: torch.Tensor,
    loss: str = "distill",
    hidden: torch.Tensor | None = None,
    path_only: bool = False,
    sampling: SamplingConfig = TrainHeadsConfig().teacher,
) -> torch.Tensor:
    """Mean over layers (and a path input's depths) of the loss of layer i at t for x[t + 1 + i]
    (see the module docstring), one sequence ids [T]; `hidden` [T, hidden]: its base states when
    already known (`CachedStates`); `path_only`: the path input's depths alone; `sampling`: the
    "sampled" teacher's transforms (min-p, penalty θ, window W)."""
    hidden = base_hidden(engine, ids) if hidden is None else hidden.to(torch.float32)
    targets = vocab_targets(draft_layers, ids.to(engine.device))
    rows = weight  # the head's rows the layers draft from: the draft vocabulary's, or all
    if draft_layers.vocab is not None:
        rows = weight.index_select(0, draft_layers.vocab.to(weight.device))
    teacher, windows = None, None  # windows: the "sampled" / "coupled" teacher's penalty masks [T, V]
    if loss == "distill":
        with torch.no_grad():  # base probabilities [T, V]: row t is the base's x[t + 1]
            # within the draft vocabulary: the softmax of its rows alone (6x fewer on SmolLM2)
            teacher = F.softmax(base_logits(engine, rows, hidden), dim=-1)
    elif loss in ("sampled", "coupled"):
        # the teacher after decoding's transforms, the student's logits after the same penalty (both
        # are penalised before a draft is ranked); min-p cuts the teacher only, so the student is
        # asked to put its mass where sampling can draw ("coupled" cuts the student too, below)
        with torch.no_grad():
            teacher, windows = sampled_teacher(
                base_logits(engine, rows, hidden), ids, draft_layers.vocab, sampling
            )
    roots = root_embeddings(engine, draft_layers, ids)
    scored: list[tuple[int, torch.Tensor]] = []  # (i, logits of x[t + 1 + i])
    if path_only:
        with torch.no_grad():
            first_state = draft_layers.chain(hidden, 1, roots)[0][0]
    else:
        chain = draft_layers.chain(hidden, None, roots)
        scored += [(i, F.linear(normed, rows)) for i, (_, normed) in enumerate(chain, start=1)]
        first_state = chain[0][0]
    if draft_layers.path is not None:
        scored += list(enumerate(path_logits(engine, weight, draft_layers, first_state, ids), start=2))
    losses = []
    for i, logits in scored:
        shift = i + 1
        if teacher is None:
            losses.append(F.cross_entropy(logits[:-shift].float(), targets[shift:], ignore_index=-100))
        else:  # layer i at t predicts x[t + 1 + i]: the base's row t + i
            soft = teacher[i : teacher.shape[0] - 1]  # [T - shift, V]
            student = logits[:-shift].float()
            if windows is not None:  # row t drafts x[t + 1 + i], whose window is row t + i's
                student = penalise(student, windows[i : teacher.shape[0] - 1], sampling.penalty)
            if loss == "coupled":  # decoding ranks the draft after the same min-p cut
                losses.append(1 - coupled_hit(soft, min_p_filter(student, sampling.min_p)).mean())
            else:
                losses.append(-(soft * F.log_softmax(student, dim=-1)).sum(-1).mean())
    return torch.stack(losses).mean()


@dataclass
class DraftAccuracy:
    """Held-out top-1 rates: the base head (+1) against the corpus, and per draft layer (+2, +3, +4)
    against the corpus and against the base model's own top-1 for that token (what greedy
    verification accepts)."""

    base: float
    layers: list[float]
    agreement: list[float]
    path_layers: list[float]  # a path input's depths 2.. (teacher-forced path) against the corpus ...
    path_agreement: list[float]  # ... and against the base's top-1; both empty without one
    # per draft layer, the chance that its first draft is the token sampling draws under `sampling`
    # (penalty and min-p on both sides, the same Gumbel noise: `coupled_hit`), what coupled
    # verification accepts at that depth of a one-candidate chain; empty when greedy
    acceptance: list[float] = field(default_factory=list)


@torch.no_grad()
def draft_accuracy(
    engine: Engine,
    draft_layers: DraftLayers,
    sequences: Sequence[torch.Tensor],
    sampling: SamplingConfig | None = None,
) -> DraftAccuracy:
    """Held-out rates over `sequences`; with `sampling` (not greedy) also each layer's coupled
    acceptance under those transforms."""
    weight = head_weight(engine)
    layers = len(draft_layers)
    hits, agree, totals = [0] * (1 + layers), [0] * layers, [0] * (1 + layers)
    accepted = [0.0] * layers
    sampled = sampling if sampling is not None and not sampling.greedy else None
    path_hits = [0] * (layers - 1 if draft_layers.path is not None else 0)
    path_agree = list(path_hits)
    for ids in sequences:
        hidden = base_hidden(engine, ids)
        targets = ids.to(engine.device)
        base = base_logits(engine, weight, hidden)
        base_top = base.argmax(-1)  # [T]: the base's pick for x[t + 1]
        roots = root_embeddings(engine, draft_layers, ids)
        heads = [base] + draft_logits(weight, draft_layers, hidden, roots)
        # once per sequence, every layer's rows slice it
        drawn = None if sampled is None else sampled_teacher(base, ids, None, sampled)
        for i, logits in enumerate(heads):
            shift = i + 1
            top = logits[:-shift].argmax(-1)
            if i:  # a draft layer's pick among the ids it drafts, as at inference
                top = vocab_ids(draft_layers, top)
            hits[i] += int((top == targets[shift:]).sum())
            totals[i] += targets.numel() - shift
            if i:
                agree[i - 1] += int((top == base_top[i:-1]).sum())
            if i and sampled is not None and drawn is not None:
                accepted[i - 1] += float(
                    coupled_acceptance(draft_layers.vocab, drawn, logits, i, sampled).sum()
                )
        if path_hits:
            first_state = draft_layers.chain(hidden, 1, roots)[0][0]
            for i, logits in enumerate(path_logits(engine, weight, draft_layers, first_state, ids), start=2):
                top = vocab_ids(draft_layers, logits[: -(i + 1)].argmax(-1))
                path_hits[i - 2] += int((top == targets[i + 1 :]).sum())
                path_agree[i - 2] += int((top == base_top[i:-1]).sum())
    rates = [h / t if t else 0.0 for h, t in zip(hits, totals)]
    agreement = [a / t if t else 0.0 for a, t in zip(agree, totals[1:])]
    path_rates = [h / t if t else 0.0 for h, t in zip(path_hits, totals[2:])]
    path_agreement = [a / t if t else 0.0 for a, t in zip(path_agree, totals[2:])]
    acceptance = [a / t if t else 0.0 for a, t in zip(accepted, totals[1:])] if sampled else []
    return DraftAccuracy(rates[0], rates[1:], agreement, path_rates, path_agreement, acceptance)


def coupled_acceptance(
    vocab: torch.Tensor | None,
    targets: tuple[torch.Tensor, torch.Tensor | None],
    draft: torch.Tensor,
    layer: int,
    sampling: SamplingConfig,
) -> torch.Tensor:
    """targets: `sampled_teacher` of the base's logits over the whole vocabulary (row t: x[t + 1]),
    draft [T, K] layer `layer`'s logits over the draft vocabulary `vocab` (row t: x[t + 1 + layer])
    -> [T - 1 - layer] per position the chance that the draft's first candidate is the target's
    sample: both sides penalised over the sampled token's window, min-p cut, ranked with the same
    noise (`coupled_hit`)."""
    teacher, _ = targets  # [T, V]
    return coupled_hit(teacher[layer:-1], drafted_rows(vocab, targets, draft, layer, sampling))


def drafted_rows(
    vocab: torch.Tensor | None,
    targets: tuple[torch.Tensor, torch.Tensor | None],
    draft: torch.Tensor,
    layer: int,
    sampling: SamplingConfig,
) -> torch.Tensor:
    """`coupled_acceptance`'s arguments -> [T - 1 - layer, V] the draft's logits as sampling ranks them:
    over the whole vocabulary (-inf outside the draft vocabulary), penalised over the window of the
    position it drafts, min-p cut; row t drafts x[t + 1 + layer]."""
    teacher, windows = targets  # [T, V], [T, V] or None
    full = draft
    if vocab is not None:  # tokens outside the draft vocabulary are never drafted
        full = draft.new_full((draft.shape[0], teacher.shape[1]), float("-inf"))
        full[:, vocab.to(draft.device)] = draft
    rows = windows[layer:-1] if windows is not None else None  # row t drafts x[t + 1 + layer]
    return min_p_filter(penalise(full[: -(layer + 1)].float(), rows, sampling.penalty), sampling.min_p)


def frequent_tokens(ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor | None:
    """The `size` most frequent ids of `ids` [N] (ties: lower id first; never-seen ids fill up), in
    ascending order [size] int64: a draft vocabulary (model/draft_layers.py). None when `size` is 0
    or covers the whole vocabulary (nothing to restrict)."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(ids.flatten().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return order.sort().values


def save_heads(draft_layers: DraftLayers, path: Path) -> None:
    """Weights in float32; the draft vocabulary (token ids) as int64."""
    tensors = {
        heads_file_key(k): (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in draft_layers.state_dict().items()
    }
    save_file(tensors, str(path))


def load_heads(path: Path, draft_layers: DraftLayers, file_vocab: bool = False) -> dict[str, torch.Tensor]:
    """A heads file (`save_heads`' format) as a state dict for `draft_layers`; a file of another
    shape or naming is a TrainingError. The draft vocabulary stays `draft_layers`' own (training
    counts its own text's tokens) unless `file_vocab` (layers trained on as they are). A path input
    the file lacks (or of another width) starts as a copy of the root MLP and layer 1 where its width
    is the root MLP's (drafting a depth from the depth before and its token is layer 1's task one
    position on: the copy already beats the chained layer 2), else as `draft_layers`' own."""
    if not path.is_file():
        raise TrainingError(f"heads file {path} does not exist")
    tensors = read_heads_file(path)
    state = {draft_key(key): value for key, value in tensors.items() if draft_key(key) is not None}
    current = draft_layers.state_dict()
    saved_vocab = state.get(VOCAB_KEY)
    ours = current.get(VOCAB_KEY)
    other_size = saved_vocab is not None and (ours is None or ours.shape != saved_vocab.shape)
    if file_vocab and other_size:
        size = saved_vocab.numel()
        raise TrainingError(f"{path} drafts a {size}-token vocabulary: pass --draft-vocab {size}")
    if not (file_vocab and VOCAB_KEY in state and VOCAB_KEY in current):
        state.pop(VOCAB_KEY, None)
        if VOCAB_KEY in current:
            state[VOCAB_KEY] = current[VOCAB_KEY]
    layout = draft_layout(state)
    if layout.path_width and not draft_layers.path_width:
        raise TrainingError(f"{path} holds a path input: train on with --path-width {layout.path_width}")
    file_reads_root = layout.root_conditioned
    other_root = not file_reads_root or layout.root_width != draft_layers.root_width
    if draft_layers.root_conditioned and other_root:
        # plain layers, or another root input, as the start of these: the root input starts as it is
        # (zero, or for a root MLP zero output)
        state = {key: value for key, value in state.items() if not key.startswith(ROOT_PREFIX)}
        state.update({key: value for key, value in current.items() if key.startswith(ROOT_PREFIX)})
    elif not draft_layers.root_conditioned and file_reads_root:
        raise TrainingError(f"{path} holds root-conditioned draft layers: train on with --root-conditioned")
    if draft_layers.path_width and layout.path_width != draft_layers.path_width:
        state = {key: value for key, value in state.items() if not key.startswith(PATH_PREFIX)}
        if draft_layers.root_width == draft_layers.path_width:
            copies = ((ROOT_PREFIX, PATH_PREFIX + "input."), ("layers.0.", PATH_PREFIX + "layer."))
            for source, target in copies:
                copied = {key.removeprefix(source): v for key, v in state.items() if key.startswith(source)}
                state.update({target + key: value for key, value in copied.items()})
        else:
            state.update({key: value for key, value in current.items() if key.startswith(PATH_PREFIX)})
    expected = {key: value.shape for key, value in current.items()}
    if {key: value.shape for key, value in state.items()} != expected:
        raise TrainingError(
            f"{path} does not hold {len(draft_layers)} draft layers of this model's hidden size "
            f"({draft_layers.layers[0].linear.weight.shape[0]})"
        )
    return state


def write_combined(model_dir: Path, heads_file: Path, out_dir: Path) -> Path:
    """A copy of the base model directory with the draft layers inside, in the released format."""
    if out_dir.resolve() == model_dir.resolve():
        raise TrainingError("the combined checkpoint must go to a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    for key, value in read_heads_file(heads_file).items():
        tensors[RELEASED_PREFIX + key.removeprefix(HEADS_PREFIX)] = value
    save_file(tensors, str(out_dir / "model.safetensors"))
    for file in model_dir.iterdir():
        if (
            file.is_file()
            and not file.name.endswith(".safetensors")
            and file.name != "model.safetensors.index.json"
        ):
            shutil.copy2(file, out_dir / file.name)
    config = json.loads((out_dir / "config.json").read_text())
    state = {draft_key(k) or k: v for k, v in read_heads_file(heads_file).items()}
    config["medusa_heads"] = draft_layout(state).num_layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


@dataclass
class CachedStates:
    """The base model's last states over a fixed set of training sequences (`state_cache`): each
    training step then costs the draft layers' forward and backward only, not a base forward per
    sequence (on SmolLM2-135M and 2 cores, ~0.85 s per 512-token sequence, most of a step)."""

    ids: torch.Tensor  # [N, seq_len] int64
    states: torch.Tensor  # [N, seq_len, hidden] float16 (pre-norm)

    @classmethod
    def build(
        cls,
        engine: Engine,
        train_ids: torch.Tensor,
        config: TrainHeadsConfig,
        on_sequence: Callable[[int], None] | None = None,
        ranks: Ranks = Ranks(),
        split_base: bool = False,
    ) -> CachedStates:
        """`config.state_cache` sequences at random starts (their own generator, seeded from
        `config.seed`: a resumed run rebuilds the same cache). Over several ranks each computes every
        size-th sequence's states and sends them to the others; with the base split over the ranks
        they compute every sequence together (each ends with the whole states)."""
        order = torch.Generator().manual_seed(config.seed + 1)
        high = train_ids.numel() - config.seq_len
        starts = torch.randint(0, high, (config.state_cache,), generator=order).tolist()
        ids = torch.stack([train_ids[s : s + config.seq_len] for s in starts])
        states = torch.empty(
            (len(starts), config.seq_len, engine.config.hidden_size),
            dtype=torch.float16,
            device=engine.device,
        )
        with torch.no_grad():
            for i, sequence in enumerate(ids):
                if split_base or i % ranks.size == ranks.rank:
                    states[i] = base_hidden(engine, sequence).to(torch.float16)
                if on_sequence:
                    on_sequence(i + 1)
        if not split_base:
            for i in range(len(starts)):
                ranks.broadcast(states[i], i % ranks.size)
        return cls(ids, states)


class HeadsTrainer:
    """Owns the draft layers, optimiser, data order and checkpoints of one training run."""

    def __init__(
        self,
        engine: Engine,
        train_ids: torch.Tensor,
        config: TrainHeadsConfig,
        out_dir: Path,
        init_heads: Path | None = None,
        ranks: Ranks = Ranks(),
        split_base: bool = False,
    ) -> None:
        """`split_base`: `engine` is this rank's slice of a base split over `ranks` (tensor
        parallel), so every base forward is made by all ranks together, on the same sequence."""
        config.validate()
        if train_ids.numel() <= config.seq_len:
            raise TrainingError(
                f"only {train_ids.numel()} training tokens for sequences of {config.seq_len}: add text "
                "or lower --seq-len"
            )
        self.engine, self.train_ids, self.config, self.out_dir = engine, train_ids, config, out_dir
        self.ranks, self.split_base = ranks, split_base
        engine.model.requires_grad_(False)
        self.head_weight = head_weight(engine)
        torch.manual_seed(config.seed)
        vocab = frequent_tokens(train_ids, engine.config.vocab_size, config.draft_vocab)
        self.draft_layers = (
            DraftLayers(
                engine.config,
                len(engine.draft_layers),
                config.root_conditioned or config.root_width > 0,
                0 if vocab is None else vocab.numel(),
                config.root_width,
                config.path_width,
            )
            .to(engine.device, torch.float32)
            .zero_()
        )
        if vocab is not None:
            self.draft_layers.vocab.copy_(vocab)
        if config.path_only and init_heads is None:
            raise TrainingError("--path-only trains a path input on trained layers: add --init-heads")
        if init_heads is not None:  # warm start: go on from trained layers (a new schedule)
            self.draft_layers.load_state_dict(load_heads(init_heads, self.draft_layers, config.path_only))
        if config.path_only:
            for name, parameter in self.draft_layers.named_parameters():
                parameter.requires_grad_(name.startswith(PATH_PREFIX))
        self.draft_layers.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.draft_layers.parameters() if p.requires_grad],
            lr=config.lr,
            betas=(0.9, 0.999),
            weight_decay=config.weight_decay,
        )
        self.data_order = torch.Generator().manual_seed(config.seed)
        self.step = 0
        self.last_loss = float("nan")
        self.cached: CachedStates | None = None  # `state_cache`: built by cache_states or the first step
        # per optimiser step {"step", "loss", "lr"}; per evaluation {"step", "acceptance", ...}
        self.history: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        cuda_half = engine.device.type == "cuda" and engine.dtype in (torch.bfloat16, torch.float16)
        self.autocast_dtype = engine.dtype if cuda_half else None  # the layers' matmuls in the base's dtype

    def cache_states(self, on_sequence: Callable[[int], None] | None = None) -> None:
        """Build the base-state cache (`state_cache` > 0) now rather than at the first step."""
        if self.config.state_cache and self.cached is None:
            self.cached = CachedStates.build(
                self.engine, self.train_ids, self.config, on_sequence, self.ranks, self.split_base
            )

    def _step_sequences(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One optimiser step's global batch, `grad_accum` x `batch` (ids [seq_len], base states
        [seq_len, hidden] or None: compute them) pairs, drawn alike on every rank."""
        sequences: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for _ in range(self.config.grad_accum):
            if self.config.state_cache:
                self.cache_states()
                assert self.cached is not None
                count = (self.config.batch,)
                rows = torch.randint(0, self.config.state_cache, count, generator=self.data_order)
                sequences.extend((self.cached.ids[r], self.cached.states[r]) for r in rows.tolist())
                continue
            high = self.train_ids.numel() - self.config.seq_len
            starts = torch.randint(0, high, (self.config.batch,), generator=self.data_order)
            for start in starts.tolist():
                ids = self.train_ids[start : start + self.config.seq_len]
                if self.split_base:  # all ranks make every sequence's base forward together
                    with torch.no_grad():
                        sequences.append((ids, base_hidden(self.engine, ids)))
                else:  # this rank's share computes its own, in the loss
                    sequences.append((ids, None))
        return sequences

    def _loss(self, ids: torch.Tensor, states: torch.Tensor | None) -> torch.Tensor:
        config = self.config
        args = (self.engine, self.head_weight, self.draft_layers, ids, config.loss, states, config.path_only)
        if self.autocast_dtype is None:
            return draft_loss(*args, config.teacher)
        with torch.autocast("cuda", dtype=self.autocast_dtype):
            return draft_loss(*args, config.teacher)

    def train_step(self) -> float:
        """One optimiser step over the global batch (this rank's share of it, gradients summed over
        the ranks); returns the batch's mean loss."""
        lr = lr_at(self.step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        scale = 1.0 / (self.config.grad_accum * self.config.batch)
        for ids, states in self.ranks.share(self._step_sequences()):
            loss = self._loss(ids, states).float() * scale
            loss.backward()
            total += loss.item()
        self.ranks.sum_gradients(self.draft_layers.parameters())
        torch.nn.utils.clip_grad_norm_(self.draft_layers.parameters(), 1.0)
        self.optimizer.step()
        self.step += 1
        self.last_loss = self.ranks.sum(total)
        self.history.append({"step": self.step, "loss": self.last_loss, "lr": lr})
        return self.last_loss

    def save_checkpoint(self) -> Path:
        """Write OUT/checkpoint.pt (rank 0; the other ranks hold the same state)."""
        path = self.out_dir / CHECKPOINT
        if not self.ranks.main:
            return path
        temporary = path.with_suffix(".tmp")
        torch.save(
            {
                "step": self.step,
                "draft_layers": self.draft_layers.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "data_order": self.data_order.get_state(),
                "config": asdict(self.config),
                "history": self.history,
                "evaluations": self.evaluations,
            },
            temporary,
        )
        temporary.replace(path)  # atomic: a crash never leaves a torn checkpoint
        return path

    def load_checkpoint(self) -> None:
        path = self.out_dir / CHECKPOINT
        if not path.is_file():
            raise TrainingError(f"--resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=True)
        saved = dict(state["config"])
        ours = {k: v for k, v in asdict(self.config).items() if k not in RESUMABLE}
        if {k: v for k, v in saved.items() if k not in RESUMABLE} != ours:
            changed = sorted(k for k in ours if saved.get(k) != ours[k])
            raise TrainingError(f"--resume: settings differ from the checkpoint's ({', '.join(changed)})")
        self.draft_layers.load_state_dict(state["draft_layers"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.data_order.set_state(state["data_order"])
        self.step = int(state["step"])
        self.history = list(state.get("history", []))
        self.evaluations = list(state.get("evaluations", []))

    def run(
        self,
        on_step: Callable[[int, float], None] | None = None,
        evaluate: Callable[[], DraftAccuracy] | None = None,
        on_evaluation: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Train to `steps`, a checkpoint every `checkpoint_every` steps and at the end. With
        `evaluate` (rank 0), the layers are scored every `eval_every` steps; each result goes to
        `evaluations` and `on_evaluation`."""
        while self.step < self.config.steps:
            loss = self.train_step()
            if on_step:
                on_step(self.step, loss)
            every = self.config.eval_every
            if evaluate is not None and every and (self.step % every == 0 or self.step == self.config.steps):
                self.draft_layers.eval()
                with torch.no_grad():
                    accuracy = evaluate()
                self.draft_layers.train()
                entry = {"step": self.step, **accuracy_figures(accuracy)}
                self.evaluations.append(entry)
                if on_evaluation:
                    on_evaluation(entry)
            if self.step % self.config.checkpoint_every == 0 or self.step == self.config.steps:
                self.save_checkpoint()


def accuracy_figures(accuracy: DraftAccuracy) -> dict[str, Any]:
    """A `DraftAccuracy` as the report's figures."""
    return {
        "base_top1": accuracy.base,
        "draft_top1": accuracy.layers,
        "draft_agrees_with_base": accuracy.agreement,
        "draft_coupled_acceptance": accuracy.acceptance,
    }


def evaluation_sequences(ids: torch.Tensor, seq_len: int, count: int) -> list[torch.Tensor]:
    usable = ids.numel() // seq_len
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(min(count, usable))] or [ids]
