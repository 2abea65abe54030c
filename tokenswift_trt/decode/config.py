"""A request's decoding settings (`GenerationConfig`), their checks and the errors a request can fail with.

`GenerationConfig.validate` checks what needs no engine; `state.new_decode_state` checks the rest
against the engine when it allocates the request's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenswift_trt.decode.tree import TreeSpec, TreeSpecError, build_static_tree
from tokenswift_trt.model.decoder import drafts_along_paths
from tokenswift_trt.model.draft_adaptation import AdaptationSettings
from tokenswift_trt.model.engine import Engine
from tokenswift_trt.model.sampling import PositionKeyedRandom, RandomSource, SamplingConfig

METHODS = ("tokenswift", "ar")
AUTO = "auto"
DRAFT_SOURCES = (AUTO, "partial", "verify")

MAX_TREE_NODES = 1024  # static tree nodes per verify pass (the paper's 1,3,3,3 has 41; --tree auto <= 41)


class GenerationError(ValueError):
    """A request that cannot run as given (the message says what to change)."""


class MemoryAdmissionError(GenerationError):
    """A request whose caches do not fit the memory budget (a scheduler keeps it queued until they do)."""


def check_tree_size(spec: TreeSpec) -> None:
    """Refuse a static tree of more than MAX_TREE_NODES nodes from its spec alone (a 300,300 tree's
    mask would take gigabytes to build before any admission could count it)."""
    nodes, level = 1, 1
    for width in spec.branching:
        level *= width
        nodes += level
    if nodes > MAX_TREE_NODES:
        raise GenerationError(
            f"tree '{spec}' has {nodes:,} nodes, more than the {MAX_TREE_NODES:,} one verify pass takes: "
            "give a smaller tree (e.g. 1,3,3,3) or the tree auto"
        )


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    method: str = "tokenswift"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # "auto": tuned to the machine while generating (autotune.py), every plan lossless;
    # "1,3,3,3" with ngram_topk 20 and the partial draft source is the paper's configuration;
    # given as text (or a TreeSpec), held parsed (`TreeSpec.parse`); `str(tree)` is its text form
    tree: TreeSpec = TreeSpec(auto=True)
    ngram_topk: int = 20  # ignored with tree="auto"
    kv_budget: int = 4096
    # recent region of the partial cache: committed tokens are appended there and the selection is
    # redone when it fills (None = B/4, the spec's); smaller = fresher selection, more selections
    kv_recent: int | None = None
    # "partial": the paper's separate draft forward of the root on the partial KV cache;
    # "verify": draft layers read the verify pass's hidden state of the last accepted token
    # (no draft forward, no partial cache; depth d of the tree uses draft layer d);
    # "auto": verify with tree="auto", partial with a static tree (`resolved_draft_source`)
    draft_source: str = AUTO
    seed: int | None = None
    ignore_eos: bool = False
    max_length: int | None = None  # engine maximum (prompt + generated); default: the model's
    prefill_chunk: int = 1024
    memory_budget: int | None = None  # bytes the caches may use; default: what is free now
    # fixed-shape steps over the whole cache (static_step.py), CUDA-graph captured on a GPU;
    # None = on for CUDA torch engines, off elsewhere
    static_steps: bool | None = None
    # the whole iteration on the device (device_loop.py), one CUDA graph per plan on a GPU; drafts
    # from the verify pass (the draft source it resolves to). None: on with CUDA where it runs
    # (`runs_device_loop`), the host loop elsewhere; False: the host loop
    device_loop: bool | None = None
    # fixed-shape steps through torch.compile (static_step.compiled_forward; implies static steps)
    compile_steps: bool = False
    # each request adapts its own copy of the draft layers to what it commits (model/draft_adaptation.py):
    # one optimiser step per `adapt_block` committed positions, over the newest `adapt_span`; off by
    # default: on a CPU a step costs more than it gains, on a GPU it is not measured yet
    # (docs/smollm2.md#draft-layers-that-keep-up); both the host loop and the device loop adapt
    adapt_drafts: bool = False
    adapt_block: int = 16
    adapt_span: int = 16  # each step trains on the newest this many committed positions
    adapt_scope: str = "all"  # "all": every draft-layer parameter; "layer1": layer 1 and the root input
    adapt_optimizer: str = "adam"  # "adam" or "sgd"
    adapt_lr: float | None = None  # None: 3e-4 with Adam, 3e-2 with SGD
    # layers with a draft vocabulary: "request" drafts over it plus the request's own tokens, "draft" over it
    adapt_vocab: str = "request"

    def __post_init__(self) -> None:
        """The tree given as text ("auto", "1,3,3,3") is parsed here, once; a malformed one is a
        GenerationError naming it."""
        try:
            object.__setattr__(self, "tree", TreeSpec.parse(self.tree))
        except TreeSpecError as error:
            raise GenerationError(str(error)) from None

    @property
    def resolved_draft_source(self) -> str:
        if self.draft_source != AUTO:
            return self.draft_source
        return "verify" if self.tree.auto or self.device_loop else "partial"

    @property
    def prefers_device_loop(self) -> bool:
        """Whether the device loop runs where it can (`runs_device_loop`): asked for, or left to the
        default while drafting from the verify pass."""
        if self.method != "tokenswift" or self.device_loop is False:
            return False
        return self.device_loop is True or self.resolved_draft_source == "verify"

    def runs_device_loop(self, engine: Engine, random: RandomSource) -> bool:
        """Whether this request runs the device loop on `engine`: as `device_loop` says, and where it is
        None on CUDA with a PyTorch engine whose iteration a graph can hold (position-keyed noise;
        draft layers without a path input, which draft level by level on the host). On a CPU the host
        loop is the default (docs/architecture.md)."""
        if not self.prefers_device_loop:
            return False
        if self.device_loop:
            return True
        return (
            engine.device.type == "cuda"
            and engine.model.fixed_shape_steps
            and isinstance(random, PositionKeyedRandom)
            and not drafts_along_paths(engine.draft_layers)
        )

    @property
    def adaptation(self) -> AdaptationSettings:
        return AdaptationSettings(
            block=self.adapt_block,
            span=self.adapt_span,
            scope=self.adapt_scope,
            optimizer=self.adapt_optimizer,
            lr=self.adapt_lr,
            vocab=self.adapt_vocab,
        )

    @property
    def adapts_drafts(self) -> bool:
        """Whether this request adapts its draft layers: as `adapt_drafts` says, for TokenSwift."""
        return self.adapt_drafts and self.method == "tokenswift"

    def validate(self) -> None:
        """Engine-independent checks; raise GenerationError naming the bad value."""
        try:
            self.sampling.validate()
            self.adaptation.validate()
            if not self.tree.auto:
                check_tree_size(self.tree)  # counted from the spec before any tensor is built
                build_static_tree(self.tree.branching)
        except ValueError as error:
            raise GenerationError(str(error)) from None
        if self.method not in METHODS:
            raise GenerationError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_source not in DRAFT_SOURCES:
            raise GenerationError(
                f"draft source must be one of {', '.join(DRAFT_SOURCES)}, got {self.draft_source!r}"
            )
        if self.max_new_tokens <= 0:
            raise GenerationError(f"max new tokens must be positive, got {self.max_new_tokens}")
        if self.ngram_topk < 0:
            raise GenerationError(f"n-gram top-k must be >= 0, got {self.ngram_topk}")
        if self.kv_budget < 4:
            raise GenerationError(f"the partial KV budget must be at least 4, got {self.kv_budget}")
        if self.kv_recent is not None and not 1 <= self.kv_recent < self.kv_budget:
            raise GenerationError(
                f"the partial cache's recent region must be in [1, {self.kv_budget}) (below the "
                f"budget), got {self.kv_recent}"
            )
        if self.max_length is not None and self.max_length < 2:
            raise GenerationError(
                f"max length must be at least 2 (a prompt token and a new one), got {self.max_length}: "
                "leave it out for the model's"
            )
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise GenerationError(f"the memory budget must be positive, got {self.memory_budget} bytes")
        if self.prefill_chunk < 1:
            raise GenerationError(f"prefill chunk must be positive, got {self.prefill_chunk}")
        if self.compile_steps and self.static_steps is False:
            raise GenerationError("compiled steps are fixed-shape steps: they need static steps on")
        if self.device_loop and self.method == "tokenswift":
            if self.resolved_draft_source != "verify":
                raise GenerationError(
                    "the device loop drafts from the verify pass: use --draft-source verify, or drop "
                    "--device-loop for partial-cache drafting (the host loop's)"
                )
