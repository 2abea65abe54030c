// Entry points of the CPU kernels (one extension module, built by runtime/kernels.load_cpu_kernels).
#pragma once

// Only ATen's core headers: each kernel file then compiles in ~10 s on the 2-core machine instead
// of ~45 s with torch/extension.h (the whole C++ API); module.cpp adds pybind11's Tensor caster.
#include <ATen/core/Tensor.h>

// tree_attention_cpu.cpp: query [heads, T, D], keys/values [kv_heads, prefix + T, D] (rows contiguous),
// tree_mask [T, ceil(T / 32)] int32 -> [heads, T, D].
at::Tensor tree_attention_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& tree_mask, double scale);

// sampling_cpu.cpp: logits [N, V] float32, windows [1 or N, W] int64, noise [N, V] float64 or empty
// -> [N, width] int64: the `width` best tokens of processed scores (+ noise) per row.
at::Tensor gumbel_topk_cpu(const at::Tensor& logits, const at::Tensor& windows, const at::Tensor& noise,
                           double penalty, bool greedy, double temperature, double log_min_p, int64_t keep,
                           int64_t width);

// linear_cpu.cpp: weight [N, K] float32 -> packed [ceil(N / W), K, W] (W = 48 with AVX-512, else 24);
// input [M, K] float32, bias [N] or empty -> [M, N], every element one in-order chain over k (the same
// bits for any M).
at::Tensor pack_linear_cpu(const at::Tensor& weight);
at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& bias, int64_t outputs);
