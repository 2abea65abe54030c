"""What every command shares: one-line errors, loading a model, the sampling options and the config."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

DTYPES = ("float32", "bfloat16", "float16", "float64")


class CliError(click.ClickException):
    exit_code = 2


def report_dir(ctx: click.Context, param: click.Parameter, path: Path) -> Path:
    """A benchmark's --out, created as the command starts: a place it cannot write fails in one line
    before the run, not after it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CliError(
            f"cannot write the report to {path}: {error.strerror or error}: give another --out"
        ) from None
    return path


def report_out_option(default: str):
    """A benchmark's --out (`report_dir` creates it as the command starts)."""
    return click.option(
        "--out",
        type=click.Path(path_type=Path),
        default=Path(default),
        show_default=True,
        callback=report_dir,
    )


def dataset_option(flag: str, what: str, required: bool = True):
    """A repeatable option naming data read with Hugging Face datasets (training/data.py)."""
    return click.option(
        flag,
        type=click.Path(path_type=Path),
        multiple=True,
        required=required,
        help=f"{what}: .txt, .jsonl, .parquet or .csv files (or compressed: .gz ...) or folders of them, "
        "read with Hugging Face datasets (repeatable)",
    )


def field_option(function):
    """`--field`: the text's column in table-like data."""
    return click.option(
        "--field", default="text", show_default=True, help="the text's column in .jsonl/.parquet/.csv data"
    )(function)


def given_command(name: str) -> str:
    """The running command with the options given (defaults left out), as a report records it."""
    ctx = click.get_current_context()
    words = [name]
    for param in ctx.command.params:
        if param.name not in ctx.params:  # not in a rank's context (tp_launch invokes the callback)
            continue
        if ctx.get_parameter_source(param.name) == ParameterSource.DEFAULT:
            continue
        flag, value = param.opts[0], ctx.params[param.name]
        if isinstance(value, dict):
            words += [f"{flag} {key}={item}" for key, item in value.items()]
        elif value is True:
            words.append(flag)
        elif value is False and param.secondary_opts:  # --no-edit
            words.append(param.secondary_opts[0])
        elif isinstance(value, (tuple, list)):  # a repeatable option: the flag once per value
            words += [f"{flag} {item}" for item in value]
        else:
            words.append(f"{flag} {value}")
    return " ".join(words)


def unequal_tokens_note(device: str, dtype: str) -> str:
    """What a user should know when TokenSwift's tokens are not AR's (bench, demo)."""
    if device.startswith("cuda") and "float16" in dtype:  # bfloat16 or float16
        return (
            f"note: tokens differ from AR's: in {dtype.removeprefix('torch.')} on a GPU a verify of several "
            "tokens rounds the logits differently from a 1-token step, so sampling parts where two tokens "
            "nearly tie (each token is still drawn from the model's distribution; docs/gpu.md)"
        )
    return (
        f"warning: tokens differ from AR's on a {dtype.removeprefix('torch.')} {device} engine, where they "
        "should be equal: please report the command (docs/runtime.md)"
    )


def fail(error: Exception) -> CliError:
    """The first line of an error's message as a CLI error."""
    return CliError(str(error).splitlines()[0] if str(error) else type(error).__name__)


@dataclass
class Source:
    """A loaded model (`api.Model`) and, under tensor parallelism, this process's ranks."""

    model: Any  # tokenswift_trt.api.Model
    ranks: Any = None  # tp_launch.Ranks when tensor parallel, else None

    @property
    def engine(self) -> Any:
        return self.model.engine

    @property
    def codec(self) -> Any:
        return self.model.codec

    @property
    def defaults(self) -> dict[str, Any]:
        return self.model.defaults

    @property
    def name(self) -> str:
        return self.model.name

    def record(self) -> dict[str, str | None]:
        return self.model.record()

    @property
    def model_dir(self) -> Path | None:
        return self.model.origin.model_dir

    @property
    def engine_dir(self) -> Path | None:
        return self.model.origin.engine_dir


def resolve_source(
    model: str | None, model_dir: Path | None, engine_dir: Path | None, heads: Path | None
) -> tuple[Path | None, Path | None, Path | None, dict[str, Any]]:
    """(model_dir, engine_dir, heads, defaults) from the source options: `--model PRESET` names a
    preset whose model directory is on this machine (bundled or prepared by `make models`); a
    `--model-dir` takes the settings its `tokenswift_defaults.json` records (written by `make models`)."""
    from tokenswift_trt.api import ApiError, Origin

    try:
        origin, defaults = Origin(model, model_dir, engine_dir, heads).resolved()
    except ApiError as error:
        raise fail(error) from None
    return origin.model_dir, origin.engine_dir, origin.heads, defaults


def no_draft_layers_line(source: Path, model_dir: Path | None) -> str:
    """The one line said when a model has no draft layers: what that means and how to get them."""
    from tokenswift_trt.builder.presets import MODEL_DIR_HEADS, draft_layers_hint

    return (
        f"{source} has no draft layers ({MODEL_DIR_HEADS}): TokenSwift drafts with zero-initialised ones "
        f"and gains little over AR (the output is still the model's); {draft_layers_hint(model_dir)}"
    )


def load_source(
    model: str | None,
    model_dir: Path | None,
    engine_dir: Path | None,
    heads: Path | None,
    dtype: str | None,
    device: str,
    quiet: bool,
    kernels: dict[str, Any] | None = None,
    tp: int = 1,
    tp_timeout: float = 120.0,
    data_parallel: bool = False,
) -> Source:
    """`api.load` with the command's options; every failure is one line, and what loading noticed is
    said on stderr. `tp` > 1: this process's rank of a tensor-parallel run (tp_launch.py), started
    before anything loads. `data_parallel`: a launcher's (torchrun's) processes each load the whole
    model for requests of their own (`batch`), not as tensor-parallel ranks."""
    import torch

    from tokenswift_trt.api import ApiError, Origin, load_resolved

    from .tp_launch import launched_ranks

    try:
        origin, defaults = Origin(model, model_dir, engine_dir, heads).resolved()
        ranks = None
        if origin.engine_dir is not None:  # an engine built with `build --tp M` loads with --tp M only
            check_engine_tp(origin.engine_dir, tp)
        # tensor parallel: checked, started and agreed on before loading
        if tp > 1 or (launched_ranks() > 1 and not data_parallel):
            if not origin.directory.is_dir():
                kind = "model" if origin.model_dir is not None else "engine"
                raise ApiError(f"{kind} directory {origin.directory} does not exist")
            ranks = _start_ranks(
                tp, tp_timeout, origin.model_dir, origin.engine_dir, dtype, device, kernels or {}
            )
            device = ranks.device
            if device == "cpu" and "threads" not in (kernels or {}):  # the ranks' share, as launched
                kernels = {**(kernels or {}), "threads": str(torch.get_num_threads())}
        tp_group = ranks.tp if ranks is not None else None
        loaded = load_resolved(origin, defaults, dtype, device, kernels, tp_group)
    except ApiError as error:
        raise fail(error) from None
    for message in loaded.fallbacks:  # running without the CUDA kernel is always said
        click.echo(f"warning: {message}", err=True)
    if loaded.untrained_drafts and not quiet:  # an untrained-heads note can be silenced
        click.echo(f"warning: {no_draft_layers_line(origin.directory, origin.model_dir)}", err=True)
    return Source(loaded, ranks)


def check_engine_tp(engine_dir: Path, tp: int) -> None:
    """One line, before any rank starts or weight loads, when `engine_dir` was built with `build --tp M`
    for another --tp."""
    from tokenswift_trt.model.engine_dir import EngineDirError, check_tp_size, engine_tp_size

    try:
        check_tp_size(engine_tp_size(engine_dir), engine_dir, tp)
    except EngineDirError as error:
        raise fail(error) from None


def _start_ranks(
    tp: int,
    timeout_s: float,
    model_dir: Path | None,
    engine_dir: Path | None,
    dtype: str | None,
    device: str,
    kernels: dict[str, Any],
) -> Any:
    """`tp_launch.launch` with its failures as one line; the ranks end with the command."""
    from tokenswift_trt.model.config import ConfigError
    from tokenswift_trt.model.tensor_parallel import TensorParallelError

    from .tp_launch import launch

    try:
        ranks = launch(tp, timeout_s, model_dir or engine_dir / "model", dtype, device, kernels)
    except (ConfigError, TensorParallelError, RuntimeError) as error:
        raise fail(error) from None
    click.get_current_context().call_on_close(ranks.close)
    return ranks


def add_options(function, options):
    for option in reversed(options):
        function = option(function)
    return function


def source_options(function):
    return add_options(
        function,
        [
            click.option(
                "--model",
                "model",
                default=None,
                help="preset whose model is on this machine (swift-tiny, smollm2-135m after `make models`)",
            ),
            click.option(
                "--model-dir",
                type=click.Path(path_type=Path),
                default=None,
                help="Hugging Face model directory",
            ),
            click.option(
                "--engine",
                "engine_dir",
                type=click.Path(path_type=Path),
                default=None,
                help="engine directory from `build`",
            ),
            click.option(
                "--heads",
                type=click.Path(path_type=Path),
                default=None,
                help="draft-layer heads file (safetensors)",
            ),
        ],
    )


def _kernel_settings(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    from tokenswift_trt.kernels.config import KernelConfigError, parse_kernel_settings

    try:
        return parse_kernel_settings(values)
    except KernelConfigError as error:
        raise click.BadParameter(str(error), ctx, param) from None


def _thread_count(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from tokenswift_trt.kernels.config import KernelConfig, KernelConfigError

    if value is not None:
        try:
            KernelConfig().updated({"threads": value})
        except KernelConfigError as error:
            raise click.BadParameter(str(error), ctx, param) from None
    return value


def kernel_option(function):
    """`--kernel NAME=VALUE`, repeatable: kernel and fusion settings (kernels/config.py); `--threads N`
    is the `threads` setting's own option."""
    from tokenswift_trt.kernels.config import help_text

    @functools.wraps(function)
    def with_threads(*args, threads: str | None = None, **kwargs):
        if threads is not None:
            kwargs["kernels"] = {**(kwargs.get("kernels") or {}), "threads": threads}
        return function(*args, **kwargs)

    with_threads = click.option(
        "--threads",
        metavar="N|auto",
        callback=_thread_count,
        help="CPU threads (the kernel setting threads): auto follows the CPUs this process may use and "
        "drops to fewer while a busy neighbour makes fewer faster [auto]",
    )(with_threads)
    return click.option(
        "--kernel",
        "kernels",
        multiple=True,
        metavar="NAME=VALUE",
        callback=_kernel_settings,
        help="a kernel setting, repeatable (default: the engine manifest's, else the default); names "
        f"[default]: {help_text()}",
    )(with_threads)


def sampling_options(function):
    """Generation options; unset ones take the model's defaults (preset, manifest or a model directory's
    tokenswift_defaults.json), then the runtime's."""
    return add_options(
        function,
        [
            click.option("--temperature", type=float, default=None, help="0 = greedy [1.0]"),
            click.option("--top-k", type=int, default=None, help="0 = off"),
            click.option("--top-p", type=float, default=None, help="1 = off"),
            click.option("--min-p", type=float, default=None, help="0 = off; keeps >= 20 tokens"),
            click.option("--eta", type=float, default=None, help="η-sampling; 0 = off"),
            click.option("--penalty", type=float, default=None, help="contextual penalty θ; 1 = off"),
            click.option(
                "--penalty-window", type=int, default=None, help="W: tokens the penalty looks back [1024]"
            ),
            click.option(
                "--ngram-topk",
                type=int,
                default=None,
                help="n-gram branches per first token (static trees) [20]",
            ),
            click.option(
                "--tree",
                default=None,
                help="candidates per depth (the paper's: 1,3,3,3), or auto: tuned to this machine [auto]",
            ),
            click.option("--kv-budget", type=int, default=None, help="partial KV cache budget B [4096]"),
            click.option(
                "--kv-recent",
                type=int,
                default=None,
                help="partial cache recent region; the selection is redone when it fills [B/4]",
            ),
            click.option(
                "--draft-source",
                type=click.Choice(["auto", "partial", "verify"]),
                default=None,
                help="partial: draft pass on the partial KV cache (paper); verify: draft layers read "
                "the verify pass; auto: verify with --tree auto or the device loop, else partial [auto]",
            ),
            click.option(
                "--device-loop/--host-loop",
                default=None,
                help="run each iteration on the device, one CUDA graph per plan on a GPU (drafting "
                "from the verify pass), or on the host [device with CUDA, host on a CPU]",
            ),
            click.option(
                "--compile-steps",
                is_flag=True,
                default=None,
                help="fixed-shape forwards through torch.compile (fused norms, rotary, SiLU; compiles "
                "once per tree size)",
            ),
            click.option(
                "--adapt-drafts/--no-adapt-drafts",
                default=None,
                help="adapt the request's own copy of the draft layers to the text it commits (output "
                "unchanged) [off]",
            ),
            click.option(
                "--adapt-block", type=int, default=None, help="committed positions per adaptation step [16]"
            ),
            click.option(
                "--adapt-span",
                type=int,
                default=None,
                help="newest committed positions each adaptation step trains on [16]",
            ),
            click.option(
                "--adapt-scope",
                type=click.Choice(["all", "layer1"]),
                default=None,
                help="draft-layer parameters adapted: all, or layer 1 and the root input [all]",
            ),
            click.option(
                "--adapt-optimizer", type=click.Choice(["adam", "sgd"]), default=None, help="[adam]"
            ),
            click.option(
                "--adapt-lr", type=float, default=None, help="adaptation step size [3e-4 Adam, 3e-2 SGD]"
            ),
            click.option(
                "--adapt-vocab",
                type=click.Choice(["request", "draft"]),
                default=None,
                help="what adapted layers with a draft vocabulary draft over: it plus the request's own "
                "tokens, or it alone [request]",
            ),
            click.option(
                "--seed", type=click.IntRange(0, 2**64 - 1), default=None, help="default: random (reported)"
            ),
            click.option("--ignore-eos", is_flag=True, default=None, help="do not stop at EOS"),
            click.option(
                "--max-length", type=int, default=None, help="engine maximum length (default: model's)"
            ),
            click.option(
                "--dtype",
                type=click.Choice(DTYPES),
                default=None,
                help="default: float32 on a CPU, bfloat16 on CUDA, or the engine's",
            ),
            click.option("--device", default="cpu", show_default=True),
        ],
    )


def request_settings(opts: dict[str, Any]) -> dict[str, Any]:
    """The generation settings among a command's options (None = not given)."""
    from tokenswift_trt.decode.request import SETTINGS

    return {name: value for name, value in opts.items() if name in SETTINGS}


def early_defaults(
    model: str | None, model_dir: Path | None, engine_dir: Path | None, heads: Path | None
) -> dict[str, Any] | None:
    """The source's recorded settings (a preset's, a prepared model directory's, an engine manifest's),
    read before anything loads and equal to those the loaded source reports, so that a command builds
    its config once from them and a bad value is refused before loading (None: the source cannot be
    resolved, and loading will say why)."""
    try:
        return resolve_source(model, model_dir, engine_dir, heads)[3]
    except CliError:
        return None


def generation_config(
    max_new_tokens: int, method: str, opts: dict[str, Any], defaults: dict[str, Any] | None = None
):
    """The request's config, built as every entry point builds it (decode/request.py)."""
    from tokenswift_trt.decode.config import GenerationError
    from tokenswift_trt.decode.request import config_from

    try:
        return config_from(
            defaults or {}, {**request_settings(opts), "max_new_tokens": max_new_tokens, "method": method}
        )
    except GenerationError as error:
        raise fail(error) from None


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise CliError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        try:
            prompt = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CliError(f"cannot read prompt file {prompt_file}: {error}") from None
    assert prompt is not None
    if not prompt.strip():
        raise CliError("the prompt is empty: give some text")
    return prompt


def int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CliError(f"{name} must be comma-separated positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise CliError(f"{name} must be comma-separated positive integers, got {text!r}")
    return values


class PositiveGiB(click.ParamType):
    """A positive, finite number of GiB (`--memory-budget`): nan, inf, 0 and negatives are refused."""

    name = "GIB"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            amount = float(value)
        except (TypeError, ValueError):
            amount = math.nan
        if not (math.isfinite(amount) and amount > 0):
            self.fail(f"must be a positive number of GiB (e.g. 4 or 0.5), got {value!r}", param, ctx)
        return amount
