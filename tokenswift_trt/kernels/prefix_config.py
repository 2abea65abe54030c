"""Launch settings of the attention cascade's prefix block: the head sizes each kernel takes, the
Triton prefix block's tile and pipeline choices (`PrefixConfig`), their measured defaults, and the
`--kernel cascade_prefix=...` parser. Kept apart from cascade.py so the Triton kernels and the settings
read it without importing the cascade."""

from __future__ import annotations

from dataclasses import dataclass

# head sizes of the Triton prefix block (`triton_prefix`): a row block's accumulator [128, D] fp32 stays
# in registers
TRITON_PREFIX_HEAD_DIMS = (32, 64, 128)
# head sizes of the position-aligned attention (`triton_aligned`): powers of two, at least a product's 16
ALIGNED_HEAD_DIMS = (16, 32, 64, 128)


# the Triton prefix block's kernels (`triton_prefix`): "loads", every key tile through masked pointer
# loads (the default before Hopper); "split", whole key tiles unmasked and one masked
# tail per range, the softmax scale folded into the exponent's argument, P·V accumulated by the product
# itself; "tma", "split" with the whole tiles' keys and values fetched by the tensor memory accelerator
# (Hopper and later)
PREFIX_VARIANTS = ("loads", "split", "tma")


@dataclass(frozen=True)
class PrefixConfig:
    """The Triton prefix block's launch: rows and keys per tile, warps, pipelined key tiles, and which
    of its kernels (PREFIX_VARIANTS)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    variant: str = "loads"

    def text(self) -> str:
        launch = f"{self.block_m},{self.block_n},{self.num_warps},{self.num_stages}"
        return launch if self.variant == "loads" else f"{launch},{self.variant}"


def default_prefix_config(rows: int, capability: tuple[int, int] | None = None) -> PrefixConfig:
    """The launch measured best (docs/gpu.md): on Hopper and later (`capability` >= (9, 0)) the split
    loop on 64 x 64 tiles, 4 warps, 3 stages (best or near it in docs/bench/gpu-h100-prefix-sweep, at
    32K and 102K keys for 64 and 128 nodes); elsewhere the masked-loads kernel, measured on an H200,
    128-row tiles where there are more than 64 rows (the split loop spills registers on sm_80)."""
    if capability is not None and capability >= (9, 0):
        return PrefixConfig(64, 64, 4, 3, "split")
    return PrefixConfig(128, 64, 8, 3) if rows > 64 else PrefixConfig(64, 64, 4, 3)


def parse_prefix_backend(text: str) -> tuple[str, PrefixConfig | None]:
    """`flash`, `triton` or `triton:BLOCK_M,BLOCK_N,WARPS,STAGES[,VARIANT]` (e.g. `triton:128,128,8,3`
    or `triton:128,64,8,3,tma`, as `tools/triton_prefix_sweep.py` prints its best) -> (backend, launch
    or None for the default)."""
    backend, _, launch = text.partition(":")
    if backend in ("flash", "triton") and not launch:
        return backend, None
    parts = launch.split(",")
    variant = parts.pop() if len(parts) == 5 else "loads"
    if backend != "triton" or len(parts) != 4 or not all(part.isdigit() for part in parts):
        raise ValueError(
            "a prefix block is `flash`, `triton` or `triton:BLOCK_M,BLOCK_N,WARPS,STAGES[,VARIANT]`, "
            f"got {text!r}"
        )
    block_m, block_n, warps, stages = (int(part) for part in parts)
    tiles = (16, 32, 64, 128)  # larger tiles of a 128-wide head overflow a multiprocessor's memory
    if block_m not in tiles or block_n not in tiles or warps not in (1, 2, 4, 8) or not 1 <= stages <= 6:
        raise ValueError(f"{text!r}: BLOCK_M and BLOCK_N from {tiles}, WARPS from 1, 2, 4, 8, STAGES 1-6")
    if variant not in PREFIX_VARIANTS:
        raise ValueError(f"{text!r}: VARIANT is one of {', '.join(PREFIX_VARIANTS)}")
    return backend, PrefixConfig(block_m, block_n, warps, stages, variant)
