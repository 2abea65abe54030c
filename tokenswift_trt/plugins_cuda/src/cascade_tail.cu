// The FlashAttention cascade's tree block and log-sum-exp merge in one kernel (kernels/cascade.py).
//
// The cascade's prefix block leaves, per key range s, every packed row's output normalised within the
// range and its log-sum-exp. What remains per row is small: its scores against the tree's own T keys
// (ancestor mask), that block's softmax, and the weighted sum of all blocks. In PyTorch those are
// ~25 small ops per layer; here one warp per packed row does all of it in fp32:
//
//   row r of KV head h is node r % T of query head h * group + r / T (`cascade.pack_group_rows`);
//   tree block: online softmax over the visible tree keys at [prefix, prefix + T) of the cache;
//   merge: every present block weighs exp(lse_b - max) / sum; an empty range (no committed keys in
//   it, offsets[s + 1] == offsets[s]) is skipped, a row that sees nothing at all writes zeros.
#include <cmath>

#include "common.cuh"

namespace tokenswift {
namespace {

constexpr int kTailWarps = 4;

template <typename T, int kPerLane>  // head_dim = 32 * kPerLane; lane owns dims lane, lane + 32, ...
__global__ void __launch_bounds__(kTailWarps * 32) cascade_tail_kernel(CascadeTailParams p) {
    const int lane = threadIdx.x % 32;
    const int group = p.num_heads / p.num_kv_heads;
    const int rows = group * p.num_tokens;
    const int64_t packed = static_cast<int64_t>(blockIdx.x) * kTailWarps + threadIdx.x / 32;
    if (packed >= static_cast<int64_t>(p.num_kv_heads) * rows) return;
    const int kv_head = static_cast<int>(packed / rows);
    const int row = static_cast<int>(packed % rows);
    const int head = kv_head * group + row / p.num_tokens;
    const int node = row % p.num_tokens;
    const int dim = p.head_dim;

    const T* query = static_cast<const T*>(p.query) + (static_cast<int64_t>(head) * p.num_tokens + node) * dim;
    float q[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) q[j] = detail::to_float(query[j * 32 + lane]);

    // tree block: the visible tree keys, online softmax in fp32
    const int64_t prefix = *p.prefix_length;
    const T* keys = static_cast<const T*>(p.keys) + kv_head * p.cache_head_stride + prefix * dim;
    const T* values = static_cast<const T*>(p.values) + kv_head * p.cache_head_stride + prefix * dim;
    const bool* visible = p.tree_visible + static_cast<int64_t>(node) * p.num_tokens;
    float top = -INFINITY;
    float total = 0.0f;
    float acc[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) acc[j] = 0.0f;
    for (int key = 0; key < p.num_tokens; ++key) {
        if (!visible[key]) continue;  // the same for the whole warp: one row
        const T* key_row = keys + static_cast<int64_t>(key) * dim;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) dot += q[j] * detail::to_float(key_row[j * 32 + lane]);
        const float score = detail::warp_sum(dot) * p.scale;
        const float next = fmaxf(top, score);
        const float shrink = expf(top - next);  // 0 for the first key (top = -inf)
        const float weight = expf(score - next);
        total = total * shrink + weight;
        const T* value_row = values + static_cast<int64_t>(key) * dim;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) acc[j] = acc[j] * shrink + weight * detail::to_float(value_row[j * 32 + lane]);
        top = next;
    }
    const float tree_lse = total > 0.0f ? top + logf(total) : -INFINITY;

    // merge: the tree block with every non-empty key range of the prefix block
    float best = tree_lse;
    for (int split = 0; split < p.splits; ++split) {
        if (p.offsets[split + 1] > p.offsets[split]) {
            best = fmaxf(best, p.prefix_lse[split * p.lse_split_stride + kv_head * p.lse_head_stride +
                                            static_cast<int64_t>(row) * p.lse_row_stride]);
        }
    }
    float merged[kPerLane];
    float weights = 0.0f;
    if (best == -INFINITY) {  // no key anywhere: zeros, as the composition's nan_to_num gives
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) merged[j] = 0.0f;
        weights = 1.0f;
    } else {
        const float tree_weight = total > 0.0f ? expf(tree_lse - best) : 0.0f;
        weights = tree_weight;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) merged[j] = total > 0.0f ? tree_weight * (acc[j] / total) : 0.0f;
        const T* outs = static_cast<const T*>(p.prefix_out);
        for (int split = 0; split < p.splits; ++split) {
            if (p.offsets[split + 1] <= p.offsets[split]) continue;
            const float lse = p.prefix_lse[split * p.lse_split_stride + kv_head * p.lse_head_stride +
                                           static_cast<int64_t>(row) * p.lse_row_stride];
            const float weight = expf(lse - best);
            weights += weight;
            const T* out_row =
                outs + split * p.out_split_stride + kv_head * p.out_head_stride + static_cast<int64_t>(row) * p.out_row_stride;
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) merged[j] += weight * detail::to_float(out_row[j * 32 + lane]);
        }
    }
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(head) * p.num_tokens + node) * dim;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) out[j * 32 + lane] = detail::from_float<T>(merged[j] / weights);
}

template <typename T>
cudaError_t launch(const CascadeTailParams& params, cudaStream_t stream) {
    const int64_t warps = static_cast<int64_t>(params.num_heads) * params.num_tokens;  // kv_heads * rows
    const int blocks = detail::ceil_div(warps, kTailWarps);
    const dim3 threads(kTailWarps * 32);
    switch (params.head_dim) {
        case 64: cascade_tail_kernel<T, 2><<<blocks, threads, 0, stream>>>(params); break;
        case 128: cascade_tail_kernel<T, 4><<<blocks, threads, 0, stream>>>(params); break;
        case 256: cascade_tail_kernel<T, 8><<<blocks, threads, 0, stream>>>(params); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace

bool cascade_tail_supports(int32_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

cudaError_t cascade_tail(const CascadeTailParams& params, cudaStream_t stream) {
    if (params.num_tokens == 0) return cudaSuccess;
    if (params.query == nullptr || params.keys == nullptr || params.values == nullptr || params.tree_visible == nullptr ||
        params.prefix_length == nullptr || params.offsets == nullptr || params.out == nullptr ||
        (params.splits > 0 && (params.prefix_out == nullptr || params.prefix_lse == nullptr)) ||
        params.num_kv_heads <= 0 || params.num_heads % params.num_kv_heads != 0 || params.splits < 0 ||
        !cascade_tail_supports(params.head_dim)) {
        return cudaErrorInvalidValue;
    }
    return params.dtype == DataType::kFloat16 ? launch<__half>(params, stream) : launch<__nv_bfloat16>(params, stream);
}

}  // namespace tokenswift
