// KV-importance selection for the partial (draft) cache, per KV head:
// 1. score every cached key against the latest query summed over the KV group's query heads;
// 2. keep positions [0, sinks) and the (keep - sinks) best others: an exact radix select on the
//    scores' order-preserving 32-bit images (4 passes of 8 bits), ties broken by lower position;
// 3. write the kept positions in ascending order (an in-order block compaction) and gather their
//    K/V rows.
#include <algorithm>

#include "common.cuh"

namespace tokenswift {
namespace {

using detail::aligned16;
using detail::ceil_div;
using detail::to_float;
using detail::warp_sum;

constexpr int kScoreThreads = 256;
constexpr int kKeysPerScoreBlock = 64;
constexpr int kSelectThreads = 512;
constexpr int kGatherThreads = 256;

// Grid: x = block of 64 positions, y = KV head. One warp scores one key at a time.
template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const T* keys, const T* query, float* scores,
                                                              int64_t kv_head_stride, int group, int length) {
    __shared__ float grouped[D];  // sum of the group's query heads
    const int kv_head = blockIdx.y;
    for (int d = threadIdx.x; d < D; d += kScoreThreads) {
        float sum = 0.0f;
        for (int g = 0; g < group; ++g) sum += to_float(query[int64_t(kv_head * group + g) * D + d]);
        grouped[d] = sum;
    }
    __syncthreads();
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int first = blockIdx.x * kKeysPerScoreBlock;
    const int last = min(length, first + kKeysPerScoreBlock);
    for (int key = first + warp; key < last; key += kScoreThreads / 32) {
        const T* row = keys + kv_head * kv_head_stride + int64_t(key) * D;
        float partial = 0.0f;
        for (int d = lane; d < D; d += 32) partial += grouped[d] * to_float(row[d]);
        partial = warp_sum(partial);
        if (lane == 0) scores[int64_t(kv_head) * length + key] = partial;
    }
}

// Monotone map float -> uint32 (larger float, larger image); -0 and +0 map alike (they tie).
__device__ __forceinline__ uint32_t order_bits(float value) {
    const uint32_t bits = __float_as_uint(value + 0.0f);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Exclusive prefix count of `flag` over the block (thread order) and the block's total.
__device__ __forceinline__ int block_prefix_count(bool flag, int* warp_totals, int* total) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_totals[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    int all = 0;
    for (int w = 0; w < kSelectThreads / 32; ++w) {
        before += w < warp ? warp_totals[w] : 0;
        all += warp_totals[w];
    }
    *total = all;
    __syncthreads();  // warp_totals is reused by the next call
    return before + in_warp;
}

// Grid: one block per KV head.
__global__ void __launch_bounds__(kSelectThreads) select_kernel(const float* scores, int32_t* indices, int length,
                                                                int keep, int sinks) {
    __shared__ int histogram[256];
    __shared__ int warp_totals[kSelectThreads / 32];
    __shared__ uint32_t chosen_prefix;
    __shared__ int still_needed;
    const int kv_head = blockIdx.x;
    const float* head_scores = scores + int64_t(kv_head) * length;
    int32_t* head_indices = indices + int64_t(kv_head) * keep;

    if (threadIdx.x == 0) {
        chosen_prefix = 0;
        still_needed = keep - sinks;
    }
    __syncthreads();
    uint32_t prefix_mask = 0;
    for (int shift = 24; shift >= 0 && still_needed > 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += kSelectThreads) histogram[b] = 0;
        __syncthreads();
        const uint32_t prefix = chosen_prefix;
        for (int j = sinks + threadIdx.x; j < length; j += kSelectThreads) {
            const uint32_t bits = order_bits(head_scores[j]);
            if ((bits & prefix_mask) == prefix) atomicAdd(&histogram[(bits >> shift) & 0xffu], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int above = 0;
            for (int b = 255; b >= 0; --b) {
                if (above + histogram[b] >= still_needed) {
                    chosen_prefix = prefix | (uint32_t(b) << shift);
                    still_needed -= above;
                    break;
                }
                above += histogram[b];
            }
        }
        prefix_mask |= 0xffu << shift;
        __syncthreads();
    }
    // Kept: sinks, every image above the threshold, and the first `ties` images equal to it.
    const bool takes_others = keep > sinks;
    const uint32_t threshold = chosen_prefix;
    const int ties = takes_others ? still_needed : 0;
    int written = 0;
    int ties_seen = 0;
    for (int start = 0; start < length; start += kSelectThreads) {
        const int j = start + threadIdx.x;
        const bool candidate = takes_others && j >= sinks && j < length;
        const uint32_t bits = candidate ? order_bits(head_scores[j]) : 0u;
        const bool tie = candidate && bits == threshold;
        int tie_total = 0;
        const int tie_rank = ties_seen + block_prefix_count(tie, warp_totals, &tie_total);
        const bool kept = (j < sinks && j < length) || (candidate && bits > threshold) || (tie && tie_rank < ties);
        int kept_total = 0;
        const int slot = written + block_prefix_count(kept, warp_totals, &kept_total);
        if (kept) head_indices[slot] = j;
        written += kept_total;
        ties_seen += tie_total;
    }
}

// One warp copies one kept K row and V row; grid covers num_kv_heads * keep rows.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads) gather_kernel(const T* keys, const T* values, T* out_keys,
                                                                T* out_values, const int32_t* indices,
                                                                int64_t kv_head_stride, int64_t out_head_stride,
                                                                int keep, int rows, int head_dim) {
    const int row = blockIdx.x * (kGatherThreads / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    const int kv_head = row / keep;
    const int slot = row % keep;
    const int64_t source = kv_head * kv_head_stride + int64_t(indices[row]) * head_dim;
    const int64_t target = kv_head * out_head_stride + int64_t(slot) * head_dim;
    for (int v = lane; v < head_dim / detail::kVector; v += 32) {
        const int64_t offset = int64_t(v) * detail::kVector;
        if (out_keys) {
            *reinterpret_cast<uint4*>(out_keys + target + offset) =
                *reinterpret_cast<const uint4*>(keys + source + offset);
        }
        if (out_values) {
            *reinterpret_cast<uint4*>(out_values + target + offset) =
                *reinterpret_cast<const uint4*>(values + source + offset);
        }
    }
}

cudaError_t check(const KvSelectParams& p) {
    const bool shapes_ok = (p.head_dim == 64 || p.head_dim == 128) && p.num_kv_heads >= 1 &&
                           p.num_heads >= p.num_kv_heads && p.num_heads % p.num_kv_heads == 0 && p.keep >= 1 &&
                           p.keep <= p.length && p.sinks >= 0 && p.kv_head_stride >= int64_t(p.length) * p.head_dim;
    const bool gathers = p.out_keys || p.out_values;
    const bool gather_ok = !gathers || (p.kv_head_stride % 8 == 0 && p.out_head_stride % 8 == 0 &&
                                        p.out_head_stride >= int64_t(p.keep) * p.head_dim && aligned16(p.keys) &&
                                        (!p.out_values || (p.values && aligned16(p.values) && aligned16(p.out_values))) &&
                                        (!p.out_keys || aligned16(p.out_keys)));
    return shapes_ok && gather_ok && p.keys && p.query && p.indices ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, int D>
cudaError_t launch(const KvSelectParams& p, float* scores, cudaStream_t stream) {
    const int group = p.num_heads / p.num_kv_heads;
    const int sinks = std::min(p.sinks, p.keep);
    score_kernel<T, D><<<dim3(ceil_div(p.length, kKeysPerScoreBlock), p.num_kv_heads), kScoreThreads, 0, stream>>>(
        static_cast<const T*>(p.keys), static_cast<const T*>(p.query), scores, p.kv_head_stride, group, p.length);
    select_kernel<<<p.num_kv_heads, kSelectThreads, 0, stream>>>(scores, p.indices, p.length, p.keep, sinks);
    if (p.out_keys || p.out_values) {
        const int rows = p.num_kv_heads * p.keep;
        gather_kernel<T><<<ceil_div(rows, kGatherThreads / 32), kGatherThreads, 0, stream>>>(
            static_cast<const T*>(p.keys), static_cast<const T*>(p.values), static_cast<T*>(p.out_keys),
            static_cast<T*>(p.out_values), p.indices, p.kv_head_stride, p.out_head_stride, p.keep, rows, D);
    }
    return cudaGetLastError();
}

}  // namespace

size_t kv_select_workspace_size(const KvSelectParams& params) {
    return size_t(params.num_kv_heads) * std::max(0, params.length) * sizeof(float);
}

cudaError_t kv_importance_select(const KvSelectParams& params, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
    cudaError_t status = check(params);
    if (status != cudaSuccess) return status;
    if (workspace == nullptr || workspace_bytes < kv_select_workspace_size(params)) return cudaErrorInvalidValue;
    float* scores = static_cast<float*>(workspace);
    const bool half = params.dtype == DataType::kFloat16;
    if (params.head_dim == 64) {
        return half ? launch<__half, 64>(params, scores, stream) : launch<__nv_bfloat16, 64>(params, scores, stream);
    }
    return half ? launch<__half, 128>(params, scores, stream) : launch<__nv_bfloat16, 128>(params, scores, stream);
}

}  // namespace tokenswift
