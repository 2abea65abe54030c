// Entry points of the CPU kernels (one extension module, built by runtime/kernels.load_cpu_kernels).
#pragma once

// Only ATen's core headers: each kernel file then compiles in ~10 s on the 2-core machine instead
// of ~45 s with torch/extension.h (the whole C++ API); module.cpp adds pybind11's Tensor caster.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// The contextual penalty of one logit (above 0 divided by θ, else multiplied; increasing in z): what
// sampling_cpu.cpp applies, and what screened_head_cpu.cpp must bound, so both call this one.
inline float penalised_logit(float z, float penalty) { return z > 0.0f ? z / penalty : z * penalty; }

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
// input [M, K] float32, packed float32 or float16, bias [N] or empty -> [M, N], every element one in-order
// chain over k (the same bits for any M).
at::Tensor pack_linear_cpu(const at::Tensor& weight, bool huge_pages = true);
// zeros of `dtype` on 2 MB pages where the OS grants them (>= 2 MB; smaller: ordinary pages)
at::Tensor zeros_on_huge_pages_cpu(at::IntArrayRef sizes, at::ScalarType dtype);
// the same layout in float16 (widened to float32 as loaded: draft layers' products)
at::Tensor pack_linear_half_cpu(const at::Tensor& weight, bool huge_pages = true);
at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& bias, int64_t outputs);

// screened_head_cpu.cpp: x [R, K] float32 through a bias-free head weight [V, K] float32, given its
// float16 packed copy and per-row error bounds [V] -> logits [R, V]: the float32 product's bits for every
// token the sampler (penalty over windows [1 or R, W], greedy or min-p keeping `keep`) could keep,
// -1e30 for the rest.
at::Tensor screened_logits_cpu(const at::Tensor& x, const at::Tensor& half_packed, const at::Tensor& bounds,
                               const at::Tensor& weight, const at::Tensor& windows, double penalty, bool greedy,
                               double temperature, double log_min_p, int64_t keep);

// decoder_cpu.cpp: the decoder stack for T <= 16 new tokens. embeddings [T, hidden]; cos/sin [T, head_dim];
// weights: per layer input norm, packed Q/K/V and its bias (or empty), packed output product and bias,
// post-attention norm, packed gate/up and bias, packed down and bias; keys/values the whole cache
// [layers, kv_heads, capacity, head_dim], new K/V written at slots prefix .. prefix + T - 1; attention:
// mode 0/1 SDPA's additive bias (query heads folded / not), mode 2 the packed tree mask; queries
// [layers, T, heads, head_dim] or empty -> hidden [T, hidden] (before the final norm).
at::Tensor decoder_cpu(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& weights, const at::Tensor& keys, const at::Tensor& values,
                       int64_t prefix, const at::Tensor& attention, int64_t mode, int64_t heads, int64_t kv_heads,
                       double eps, double scale, const at::Tensor& queries);

// decoder_cpu.cpp: `decoder_cpu` for several requests' steps at once. The rows of embeddings/cos/sin are
// segments of counts[s] rows, segment s on its own cache keys[s]/values[s] (new K/V at prefixes[s] ..),
// attending with attention[s] in modes[s]; products run over all rows together (a row's bits do not
// depend on the other segments), attention per segment. queries [layers, T, heads, head_dim] or empty.
at::Tensor decoder_batch_cpu(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                             const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& keys,
                             const std::vector<at::Tensor>& values, const std::vector<int64_t>& prefixes,
                             const std::vector<int64_t>& counts, const std::vector<at::Tensor>& attention,
                             const std::vector<int64_t>& modes, int64_t heads, int64_t kv_heads, double eps,
                             double scale, const at::Tensor& queries);

// decoder_cpu.cpp: the draft layers' chain for a few rows in one call. hidden [R, hidden] (pre-norm),
// root_embedding [R, hidden] (or empty without a root input); root: none, (norm, packed U) or (hidden
// norm, norm, packed U, packed D) of a root MLP; layers: per layer input norm, packed W, post norm
// -> [2, count, R, hidden]: each layer's state before its post norm, and after it.
at::Tensor draft_chain_cpu(const at::Tensor& hidden, const at::Tensor& root_embedding, const std::vector<at::Tensor>& root,
                           const std::vector<at::Tensor>& layers, double eps);
