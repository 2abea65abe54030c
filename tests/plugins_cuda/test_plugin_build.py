"""The CUDA sources compile: kernels for sm_80 and sm_90 through the CMake build `make plugins`
runs, the torch bindings against torch's own headers, and the TensorRT plugins where TensorRT's
headers exist. Nothing here needs a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tokenswift_trt.kernels.ops import source_dir

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)


def _cuda_include() -> Path | None:
    candidates = [
        Path(os.environ.get("CUDA_HOME", "/nonexistent")) / "include",
        Path("/usr/local/cuda/include"),
    ]
    if NVCC:
        candidates.insert(0, Path(NVCC).resolve().parent.parent / "include")
    return next((path for path in candidates if (path / "cuda_runtime.h").exists()), None)


CUDA_INCLUDE = _cuda_include()
needs_nvcc = pytest.mark.skipif(
    NVCC is None or CUDA_INCLUDE is None, reason="nvcc / cuda_runtime.h not found: install the CUDA toolkit"
)


def _tensorrt_include() -> Path | None:
    roots = [os.environ.get("TENSORRT_ROOT", ""), "/usr", "/usr/local/tensorrt", "/opt/tensorrt"]
    for root in filter(None, roots):
        for candidate in (Path(root) / "include", Path(root) / "include" / "x86_64-linux-gnu"):
            if (candidate / "NvInferRuntime.h").exists():
                return candidate
    return None


@needs_nvcc
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found")
@pytest.mark.slow
def test_cmake_builds_the_kernels_for_sm80_and_sm90(tmp_path):
    build = tmp_path / "build"
    configure = subprocess.run(
        [
            "cmake",
            "-S",
            str(source_dir()),
            "-B",
            str(build),
            f"-DCMAKE_CUDA_COMPILER={NVCC}",
            "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(
        ["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True, timeout=900
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert (build / "libtokenswift_kernels.a").stat().st_size > 0
    commands = json.loads((build / "compile_commands.json").read_text())
    kernels = {Path(entry["file"]).name: entry["command"] for entry in commands}
    expected = {
        "tree_attention.cu",
        "kv_importance_select.cu",
        "rms_norm.cu",
        "rotary.cu",
        "silu_mul.cu",
        "cascade_tail.cu",
    }
    assert set(kernels) >= expected
    for command in kernels.values():
        assert "sm_80" in command and "sm_90" in command, command
    if _tensorrt_include() is None:
        assert "skipping the TensorRT plugin library" in configure.stdout
    else:
        assert (build / "libtokenswift_trt_plugins.so").exists()


@needs_nvcc
@pytest.mark.slow
def test_torch_bindings_compile_against_torch_headers(tmp_path):
    """Syntax-checks torch_ops/ops.cpp with torch's headers, as torch.utils.cpp_extension would
    compile it on a GPU machine (C++20 for torch 2.13's headers)."""
    include = Path(torch.__file__).parent / "include"
    if not (include / "c10" / "cuda" / "CUDAGuard.h").exists():
        pytest.skip("this torch build ships no c10/cuda headers")
    # A CPU wheel lacks this one generated configuration header of the CUDA build; supply it.
    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    compiler = shutil.which("g++") or pytest.skip("no g++")
    result = subprocess.run(
        [
            compiler,
            "-std=c++20",
            "-fsyntax-only",
            "-DTORCH_EXTENSION_NAME=tokenswift_cuda_kernels",
            f"-I{tmp_path}",
            f"-I{include}",
            f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{source_dir() / 'include'}",
            f"-I{CUDA_INCLUDE}",
            str(source_dir() / "torch_ops" / "ops.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_tensorrt_plugins_compile_where_tensorrt_headers_exist():
    trt_include = _tensorrt_include()
    if trt_include is None:
        pytest.skip("TensorRT headers (NvInferRuntime.h) not found: set TENSORRT_ROOT to compile the plugins")
    if NVCC is None:
        pytest.skip("nvcc not found")
    result = subprocess.run(
        [
            shutil.which("g++") or "g++",
            "-std=c++17",
            "-fsyntax-only",
            f"-I{trt_include}",
            f"-I{source_dir() / 'include'}",
            f"-I{CUDA_INCLUDE}",
            str(source_dir() / "tensorrt" / "tokenswift_plugins.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_sources_ship_with_the_package():
    root = source_dir()
    for relative in (
        "CMakeLists.txt",
        "include/tokenswift_kernels.h",
        "src/tree_attention.cu",
        "src/kv_importance_select.cu",
        "torch_ops/ops.cpp",
    ):
        assert (root / relative).is_file(), relative
    assert sys.modules["tokenswift_trt.plugins_cuda"].__file__  # importable as package data
