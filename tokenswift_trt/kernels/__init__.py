"""Kernels and their settings: custom-op registration with reference implementations, the CUDA/C++
loaders, the Triton kernels, the cascade attention, host/device transfers."""
