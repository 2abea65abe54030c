"""The library's entry points: load a model, start or resume a generation, run it.

    import tokenswift_trt as ts
    model = ts.load("swift-tiny")                       # a preset, or model_dir= / engine_dir=
    result = ts.generate(model, "Once upon a time", max_new_tokens=256)
    print(result.text, result.stats.acceptance_rate)

A run that must survive a crash keeps a journal: `start_run(model, prompt, config, journal=PATH)`, and
after a crash `resume_run(PATH, load=...)` continues it token for token. The CLI's `generate` is these
calls plus printing. Every failure is an `ApiError` whose first line says what is wrong and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenswift_trt.backends.loader import load_engine_dir
from tokenswift_trt.decode.config import GenerationConfig, GenerationError
from tokenswift_trt.decode.journal import (
    JournalError,
    JournalWriter,
    check_journal_room,
    check_new_journal,
    journal_header,
    model_identity,
    read_journal,
    recorded_kernels,
    resume_journal,
)
from tokenswift_trt.decode.loop import generate as run_generate
from tokenswift_trt.decode.request import SPEED_ONLY, config_from, engine_dir_defaults, with_fixed_seed
from tokenswift_trt.decode.stats import Stats
from tokenswift_trt.decode.text import TextCodec, TokenizerError
from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError
from tokenswift_trt.model.config import ConfigError
from tokenswift_trt.model.engine import (
    Engine,
    KernelFallbackWarning,
    UntrainedDraftLayersWarning,
    WeightsError,
    load_engine,
)
from tokenswift_trt.model.engine_dir import EngineDirError


class ApiError(ValueError):
    """A request the library cannot carry out; the first line names the problem and the fix."""


@dataclass(frozen=True)
class Origin:
    """Where a model is loaded from: exactly one of a preset name, a Hugging Face model directory or a
    built engine directory (`heads`: draft layers for a model directory)."""

    model: str | None = None
    model_dir: Path | None = None
    engine_dir: Path | None = None
    heads: Path | None = None

    def __post_init__(self) -> None:  # the Python API takes str paths as well
        for name in ("model_dir", "engine_dir", "heads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))

    def resolved(self) -> tuple[Origin, dict[str, Any]]:
        """(the directories on this machine, the settings the preset, the model directory or the engine
        manifest records: the defaults loading it reports), reading small files only."""
        from tokenswift_trt.builder.presets import PRESETS, PresetError, local_model_dir, read_model_defaults

        given = [value for value in (self.model, self.model_dir, self.engine_dir) if value is not None]
        if len(given) != 1:
            raise ApiError("give exactly one of --model PRESET, --model-dir DIR or --engine DIR")
        try:
            if self.model is None:
                if self.model_dir is not None:
                    return self, read_model_defaults(self.model_dir)
                assert self.engine_dir is not None
                return self, engine_dir_defaults(self.engine_dir)
            if self.model not in PRESETS:
                raise ApiError(
                    f"unknown preset {self.model!r}; presets: {', '.join(PRESETS)} (or pass --model-dir DIR)"
                )
            directory, preset_heads = local_model_dir(PRESETS[self.model])
        except PresetError as error:
            raise ApiError(_first_line(error)) from None
        return Origin(None, directory, None, self.heads or preset_heads), dict(PRESETS[self.model].defaults)

    @property
    def directory(self) -> Path:
        directory = self.model_dir if self.model_dir is not None else self.engine_dir
        assert directory is not None, "resolve the origin first"
        return directory


@dataclass
class Model:
    """A loaded model: engine, tokenizer, the defaults its preset or manifest sets, and what loading it
    noticed (`fallbacks`: kernels that run as their reference here; `untrained_drafts`: no draft layers)."""

    engine: Engine
    codec: TextCodec
    origin: Origin
    defaults: dict[str, Any] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    untrained_drafts: bool = False

    @property
    def name(self) -> str:
        """The directory the model was loaded from, for messages."""
        return str(self.origin.directory)

    def record(self) -> dict[str, str | None]:
        """Where this model came from (a journal's header keeps it for resuming)."""
        o = self.origin
        return {
            "model_dir": str(o.model_dir) if o.model_dir else None,
            "engine_dir": str(o.engine_dir) if o.engine_dir else None,
            "heads": str(o.heads) if o.heads else None,
        }


def load(
    model: str | None = None,
    *,
    model_dir: str | Path | None = None,
    engine_dir: str | Path | None = None,
    heads: str | Path | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    kernels: Mapping[str, Any] | None = None,
    tp: Any = None,  # model.tensor_parallel.TensorParallel: this process's rank of a TP group
) -> Model:
    """Load a preset, a Hugging Face model directory or a built engine directory. `kernels`: kernel
    settings over the engine manifest's (else over the defaults); `dtype` None: float32 on a CPU, bf16
    (fp16 before compute capability 8.0) on a GPU, an engine's own for an engine directory."""
    origin, defaults = Origin(model, model_dir, engine_dir, heads).resolved()
    return load_resolved(origin, defaults, dtype, device, kernels, tp)


def load_resolved(
    origin: Origin,
    defaults: dict[str, Any],
    dtype: str | None,
    device: str,
    kernels: Mapping[str, Any] | None,
    tp: Any = None,
) -> Model:
    """`load` for an origin already resolved (the CLI resolves first to start tensor-parallel ranks)."""
    from tokenswift_trt.decode.request import manifest_defaults

    try:
        torch.device(device)
    except RuntimeError:
        raise ApiError(
            f"unknown device {device!r}: give --device cpu or --device cuda (cuda:N for one GPU)"
        ) from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ApiError(f"--device {device} but no CUDA GPU is visible to PyTorch: use --device cpu")
    if not origin.directory.is_dir():
        kind = "model" if origin.model_dir is not None else "engine"
        raise ApiError(f"{kind} directory {origin.directory} does not exist")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntrainedDraftLayersWarning)
        warnings.simplefilter("always", KernelFallbackWarning)
        try:
            if origin.engine_dir is not None:
                if origin.heads is not None:
                    raise ApiError("--heads applies to --model-dir; an engine carries its draft layers")
                engine, manifest = load_engine_dir(
                    origin.engine_dir,
                    device=device,
                    dtype=getattr(torch, dtype) if dtype else None,
                    kernels=dict(kernels or {}),
                    tp=tp,
                )
                defaults = manifest_defaults(manifest)
                codec = TextCodec.from_dir(origin.engine_dir / "model")
            else:
                assert origin.model_dir is not None
                if dtype is None:  # the kernels' element types on GPUs (bf16 needs compute capability 8.0+)
                    on_gpu = device.startswith("cuda")
                    bf16 = on_gpu and torch.cuda.is_bf16_supported()
                    dtype = ("bfloat16" if bf16 else "float16") if on_gpu else "float32"
                engine = load_engine(
                    origin.model_dir,
                    origin.heads,
                    dtype=getattr(torch, dtype),
                    device=device,
                    kernels=KernelConfig().updated(dict(kernels or {})),
                    tp=tp,
                )
                codec = TextCodec.from_dir(origin.model_dir)
        except (
            ConfigError,
            WeightsError,
            TokenizerError,
            EngineDirError,
            KernelConfigError,
            OSError,
            RuntimeError,
        ) as error:
            raise ApiError(_first_line(error)) from None
    return Model(
        engine,
        codec,
        origin,
        defaults,
        fallbacks=[str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)],
        untrained_drafts=any(issubclass(w.category, UntrainedDraftLayersWarning) for w in caught),
    )


@dataclass
class Result:
    """A finished (or stopped) run: every new token of the request, resumed ones included."""

    token_ids: list[int]
    text: str
    stats: Stats | None  # None when a resumed journal had already finished


@dataclass
class Run:
    """A generation ready to run: its full config, what is left of it, the prompt, the tokens a journal
    already holds, and the journal writer (None without a journal, or on a rank that does not write)."""

    model: Model
    config: GenerationConfig  # the request as asked (max_new_tokens counts resumed tokens too)
    remaining: GenerationConfig  # what this process still has to generate
    prompt_ids: list[int]
    done_ids: list[int] = field(default_factory=list)
    finished: bool = False
    writer: JournalWriter | None = None
    notes: list[str] = field(default_factory=list)  # what the user should know (torn records, limits)

    def with_remaining(self, change: Callable[[GenerationConfig], GenerationConfig]) -> None:
        """Adjust what is left to run (a memory budget, tensor-parallel agreement)."""
        self.remaining = change(self.remaining)

    def execute(self, on_tokens: Callable[[list[int]], None] | None = None) -> Result:
        """Run what is left, journaling every committed token; the journal is closed either way (marked
        finished only when the run ended), so a failure leaves it resumable."""
        stats = None

        def committed(ids: list[int]) -> None:
            if self.writer is not None:
                self.writer.add(ids)
            if on_tokens is not None:
                on_tokens(ids)

        ended = False
        try:
            if not self.finished:
                try:
                    new_ids, stats = run_generate(
                        self.model.engine,
                        self.prompt_ids + self.done_ids,
                        self.remaining,
                        on_tokens=committed,
                    )
                except (GenerationError, JournalError) as error:  # a journal write fails: disk full
                    raise ApiError(_first_line(error)) from None
                self.done_ids = self.done_ids + new_ids
            ended = True
        finally:
            if self.writer is not None:
                try:
                    self.writer.close(finished=stats is not None or self.finished)
                except JournalError as error:
                    if ended:  # else the error in flight says it already
                        raise ApiError(_first_line(error)) from None
        return Result(self.done_ids, self.model.codec.decode(self.done_ids), stats)


def start_run(
    model: Model,
    prompt: str | list[int],
    config: GenerationConfig,
    journal: Path | None = None,
    journal_every: int = 64,
    writes: bool = True,
) -> Run:
    """A new generation; with `journal`, its tokens are journaled (an unfinished journal there is
    never replaced). `writes` False: another process writes the journal (tensor-parallel ranks)."""
    if journal is not None and writes:
        try:
            check_new_journal(journal, f"--resume {journal}", "delete it (or choose another --journal path)")
            check_journal_room(journal, config.max_new_tokens)
        except JournalError as error:
            raise ApiError(_first_line(error)) from None
    prompt_ids = model.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
    notes = []
    limit = config.max_length or model.engine.config.max_position_embeddings
    if len(prompt_ids) + config.max_new_tokens > limit > len(prompt_ids):
        notes.append(
            f"the engine's maximum length is {limit:,} tokens: this {len(prompt_ids):,}-token prompt leaves "
            f"room for {limit - len(prompt_ids):,} new tokens, not {config.max_new_tokens:,}"
        )
    writer = None
    if journal is not None:
        config = with_fixed_seed(config)  # the journal must know the seed to resume the same tokens
        if writes:
            header = journal_header(
                prompt_ids, config, model.record(), model_identity(model.engine, model.name)
            )
            try:
                writer = JournalWriter(journal, header, every=journal_every)
            except JournalError as error:
                raise ApiError(_first_line(error)) from None
    return Run(model, config, config, prompt_ids, writer=writer, notes=notes)


def journal_origin(journal: Path) -> tuple[Origin, str | None, dict[str, Any]]:
    """(where the model that wrote `journal` came from, its dtype, its kernel settings)."""
    try:
        state = read_journal(journal)
    except JournalError as error:
        raise ApiError(_first_line(error)) from None
    recorded = state.header.get("source") or {}
    model_dir, engine_dir, heads = (
        Path(recorded[key]) if recorded.get(key) else None for key in ("model_dir", "engine_dir", "heads")
    )
    dtype = (state.header.get("model") or {}).get("dtype") if engine_dir is None else None
    return Origin(None, model_dir, engine_dir, heads), dtype, recorded_kernels(state) or {}


def resume_run(
    journal: Path,
    model: Model,
    speed: Mapping[str, Any] | None = None,
    journal_every: int = 64,
    writes: bool = True,
) -> Run:
    """Continue the generation `journal` records with `model` (refused in one line if another model
    wrote it), under the journal's own output-deciding settings; `speed`: speed-only settings to change
    (`decode/request.py`'s SPEED_ONLY)."""
    unknown = sorted(set(speed or {}) - set(SPEED_ONLY))
    if unknown:
        raise ApiError(f"a resumed run keeps the journal's own settings: drop {', '.join(unknown)}")
    try:
        recorded_state = read_journal(journal)
        resumed = resume_journal(
            journal,
            model.engine.config.eos_token_ids,
            dict(speed or {}),
            model_identity(model.engine, model.name),
        )
        if resumed.finished and not recorded_state.finished and writes:  # it ended just before a crash
            JournalWriter(journal).close(finished=True)  # so that a new run may replace it
        writer = None if resumed.finished or not writes else JournalWriter(journal, every=journal_every)
    except JournalError as error:
        raise ApiError(_first_line(error)) from None
    notes = []
    if resumed.dropped_records:
        notes.append(f"ignored {resumed.dropped_records} torn record(s) at the end of {journal}")
    if resumed.earlier_sampler:
        notes.append(
            f"{journal} was written by an earlier version with another sampler; the continuation is sampled "
            "correctly but differs from what the original run would have written"
        )
    return Run(
        model,
        resumed.config,
        resumed.remaining_config(),
        resumed.prompt_ids,
        resumed.done_ids,
        resumed.finished,
        writer,
        notes,
    )


def generate(
    model: Model,
    prompt: str | list[int],
    max_new_tokens: int,
    *,
    journal: Path | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    **settings: Any,
) -> Result:
    """Generate up to `max_new_tokens` after `prompt` (text or token ids). `settings`: any request
    setting (`method`, `temperature`, `top_p`, `seed`, `tree`, ...; decode/request.py), over the
    model's own defaults. The tokens are the model's: those of `method="ar"` with the same settings."""
    try:
        config = config_from(model.defaults, {**settings, "max_new_tokens": max_new_tokens})
    except (GenerationError, ValueError, TypeError) as error:
        raise ApiError(_first_line(error)) from None
    return start_run(model, prompt, config, journal).execute(on_tokens)


def with_memory_budget(config: GenerationConfig, gib: float | None) -> GenerationConfig:
    """`config` with the caches limited to `gib` GiB (None: the memory free at admission)."""
    if gib is None:
        return config
    return dataclasses.replace(config, memory_budget=max(1, int(gib * (1 << 30))))


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
