"""CUDA sources of the TokenSwift kernels (built by `make plugins` or, for torch, on first use)."""
