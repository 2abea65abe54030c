"""Kernel and fusion choices of an engine, as one settings object.

`KernelConfig` holds every choice of which kernel or fusion computes what (the CPU kernels, the CUDA
attention path, fused elementwise ops, batch-invariant products, ...), each with its default. An
engine takes one at load (`engine.load_engine`, `backends.loader.load_engine_dir`); `build` records it in
the engine directory's manifest, whose value is the default there; the CLI sets fields with
`--kernel NAME=VALUE`; journals record it. The settings marked output-deciding can change the
generated tokens (another kernel rounds differently), so a journal is resumed only with the same
values (decode/journal.py); the others change only speed or memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CASCADE_MIN_WORK = 697_536  # the `auto` threshold in tree tokens x keys (measured on an H200, docs/gpu.md)


class KernelConfigError(ValueError):
    """A kernel setting is unknown or has a bad value."""


def _setting(default: Any, doc: str, output_deciding: bool, choices: tuple[Any, ...] = ()) -> Any:
    return field(
        default=default, metadata={"doc": doc, "output_deciding": output_deciding, "choices": choices}
    )


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels and fusions an engine runs. Each field's metadata holds its one-line meaning, its
    choices and whether it is output-deciding (can change tokens)."""

    cpu_kernel: str = _setting(
        "auto",
        "the compiled CPU kernels (tree attention, tiled float32 products, fused decoder, sampler): `auto` "
        "where they pay (x86 with AVX2/AVX-512), `on` everywhere they build, `off` keeps SDPA, oneDNN and "
        "PyTorch sampling",
        True,
        ("auto", "on", "off"),
    )
    screened_head: bool = _setting(
        True,
        "CPU float32: read the LM head in float16 and recompute in float32 only where sampling can look "
        "(the same tokens, bit for bit)",
        False,
    )
    huge_pages: bool = _setting(
        True, "CPU: packed weights and KV caches on 2 MB pages where the OS grants them", False
    )
    fused_elementwise: bool = _setting(
        True,
        "CUDA fp16/bf16: add + RMSNorm, rotary and SiLU·up as one kernel each, Q/K/V and gate/up as one "
        "product each",
        True,
    )
    batch_invariant: str = _setting(
        "off",
        "CUDA: `on` row-wise products, norms and position-aligned attention (a row's logits the same bits "
        "in an AR step and a verify), `products` the products and norms only",
        True,
        ("off", "on", "products"),
    )
    batched_forward: str = _setting(
        "auto",
        "how a batch of requests runs where the compiled CPU decoder does not take it: one pass with every "
        "product over all requests' rows (`on`; `auto` on CUDA, where in bf16 a row can differ in its "
        "last bits from the request's own run unless batch_invariant is on or products) or one forward "
        "per request (`off`; `auto` elsewhere)",
        True,
        ("auto", "on", "off"),
    )
    cuda_attention: str = _setting(
        "auto",
        "how verifies attend on CUDA: `auto` the FlashAttention cascade where tree tokens x keys >= "
        "cascade_min_work and the tree-attention kernel elsewhere, `kernel` never the cascade, "
        "`flash_cascade` always",
        True,
        ("auto", "kernel", "flash_cascade"),
    )
    cascade_min_work: int = _setting(
        CASCADE_MIN_WORK, "the `auto` threshold in tree tokens x keys (a positive integer)", True
    )
    cascade_tail: str = _setting(
        "kernel",
        "the cascade's tree block and merge: `kernel` one fused launch per layer, `torch` the PyTorch ops",
        True,
        ("kernel", "torch"),
    )
    cascade_prefix: str = _setting(
        "auto",
        "the cascade's prefix block: `auto` our Triton kernel where Triton and the head size allow, else "
        "FlashAttention-2; `flash`; `triton` (warns where it cannot run); "
        "`triton:BLOCK_M,BLOCK_N,WARPS,STAGES[,VARIANT]` a launch tools/triton_prefix_sweep.py measured",
        True,
    )
    tree_row_tiles: int = _setting(
        0,
        "CUDA tree-attention kernel: query row tiles per warp, 0 = chosen by rows and shared memory, 1 or 2 "
        "forces one",
        True,
        (0, 1, 2),
    )
    threads: str = _setting(
        "auto",
        "CPU threads: `auto` the CPUs this process may use (affinity and cgroup quota), fewer while a busy "
        "neighbour makes fewer faster (decode/threads.py); a number fixes the count",
        False,
    )

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            kind = type(item.default)
            if type(value) is not kind:
                raise KernelConfigError(f"kernel setting {item.name} takes {_kind_name(kind)}, got {value!r}")
            choices = item.metadata["choices"]
            if choices and value not in choices:
                raise KernelConfigError(
                    f"kernel setting {item.name} is one of {', '.join(map(str, choices))}, got {value!r}"
                )
        if self.cascade_min_work < 1:
            raise KernelConfigError(
                "kernel setting cascade_min_work is a positive integer (T x keys), got "
                f"{self.cascade_min_work}"
            )
        if self.threads != "auto" and not (self.threads.isdigit() and int(self.threads) >= 1):
            raise KernelConfigError(
                f"kernel setting threads is auto or a positive number of threads, got {self.threads!r}"
            )
        if self.cascade_prefix != "auto":
            from tokenswift_trt.kernels.prefix_config import (
                parse_prefix_backend,  # lazily: this module stays light
            )

            try:
                parse_prefix_backend(self.cascade_prefix)
            except ValueError as error:
                raise KernelConfigError(f"kernel setting cascade_prefix: {error}") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(item.name for item in dataclasses.fields(cls))

    @classmethod
    def output_deciding_names(cls) -> tuple[str, ...]:
        return tuple(item.name for item in dataclasses.fields(cls) if item.metadata["output_deciding"])

    def to_dict(self) -> dict[str, Any]:
        """Every setting, JSON-ready (a manifest's and a journal's record)."""
        return dataclasses.asdict(self)

    def output_deciding(self) -> dict[str, Any]:
        """The settings that can change the generated tokens."""
        return {name: getattr(self, name) for name in self.output_deciding_names()}

    def updated(self, settings: Mapping[str, Any]) -> KernelConfig:
        """This config with `settings` (name -> value, a typed value or its text as on the command line)
        replacing its fields; raises KernelConfigError in one line for an unknown name or a bad value."""
        known = {item.name: item for item in dataclasses.fields(self)}
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise KernelConfigError(
                f"unknown kernel setting(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        values = {name: _coerce(name, type(known[name].default), value) for name, value in settings.items()}
        return dataclasses.replace(self, **values)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any] | None) -> KernelConfig:
        """From a manifest's or journal's record (missing names take their defaults)."""
        return cls().updated(settings or {})


def parse_kernel_settings(items: Iterable[str]) -> dict[str, Any]:
    """`NAME=VALUE` items (the CLI's repeatable --kernel) -> {name: typed value}, checked against
    `KernelConfig` (each value alone; the whole config is checked where it is built)."""
    settings: dict[str, Any] = {}
    for item in items:
        name, equals, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or not name:
            raise KernelConfigError(
                f"a kernel setting is NAME=VALUE, got {item!r}; names: {describe_names()}"
            )
        settings[name] = value.strip()
    KernelConfig().updated(settings)  # unknown names and bad values fail here, before any loading
    known = {item.name: type(item.default) for item in dataclasses.fields(KernelConfig)}
    return {name: _coerce(name, known[name], value) for name, value in settings.items()}


def describe_names() -> str:
    return ", ".join(KernelConfig.names())


def help_text() -> str:
    """One line per setting: name, default, output-deciding or not (for --help)."""
    lines = []
    for item in dataclasses.fields(KernelConfig):
        default = _text(item.default)
        deciding = "; output-deciding" if item.metadata["output_deciding"] else ""
        lines.append(f"{item.name} [{default}{deciding}]")
    return ", ".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _kind_name(kind: type) -> str:
    return {bool: "on or off", int: "an integer", str: "a string"}.get(kind, kind.__name__)


_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


def _coerce(name: str, kind: type, value: Any) -> Any:
    if kind is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # threads=2 from Python
    if not isinstance(value, str) or kind is str:
        return value
    text = value.strip().lower()
    if kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise KernelConfigError(f"kernel setting {name} is on or off, got {value!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise KernelConfigError(f"kernel setting {name} takes an integer, got {value!r}") from None
    return value
