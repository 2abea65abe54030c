// Rotary position embedding of a step's queries and keys in one kernel, in place of PyTorch's ten
// (per tensor: slice, negate, concatenate, two products, a sum).
//
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x[D/2:], x[:D/2]], with every product and
// the sum rounded to the element type as PyTorch's fp16/bf16 ops round them: no reduction, so the
// outputs are the same bits as the composition's (model/rope.py apply_rotary).
//
// One warp per (head, token) row of q or k; inputs may be strided over heads and tokens (the
// projections' [T, heads, D] memory seen as [heads, T, D]), outputs are contiguous [heads, T, D].
#include "common.cuh"

namespace tokenswift {
namespace {

constexpr int kRotaryThreads = 256;
constexpr int kRowsPerBlock = kRotaryThreads / 32;

template <typename T>
__device__ __forceinline__ T rounded_product(T a, T b) {
    return detail::from_float<T>(detail::to_float(a) * detail::to_float(b));
}

template <typename T>
__global__ void __launch_bounds__(kRotaryThreads) rotary_kernel(RotaryParams params) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
    const int64_t q_rows = static_cast<int64_t>(params.num_heads) * params.num_tokens;
    const int64_t k_rows = static_cast<int64_t>(params.num_kv_heads) * params.num_tokens;
    if (row >= q_rows + k_rows) return;
    const bool is_query = row < q_rows;
    const int64_t local = is_query ? row : row - q_rows;
    const int64_t head = local / params.num_tokens;
    const int64_t token = local % params.num_tokens;
    const T* in = static_cast<const T*>(is_query ? params.query : params.key) +
                  head * (is_query ? params.query_head_stride : params.key_head_stride) +
                  token * (is_query ? params.query_token_stride : params.key_token_stride);
    T* out = static_cast<T*>(is_query ? params.query_out : params.key_out) + local * params.head_dim;
    const T* cos = static_cast<const T*>(params.cos) + token * params.head_dim;
    const T* sin = static_cast<const T*>(params.sin) + token * params.head_dim;
    const int32_t half = params.head_dim / 2;
    for (int32_t i = threadIdx.x % 32; i < params.head_dim; i += 32) {
        const T x = in[i];
        const float partner = detail::to_float(in[i < half ? i + half : i - half]);
        const T rotated = detail::from_float<T>(i < half ? -partner : partner);  // exact: a sign or a copy
        const float sum =
            detail::to_float(rounded_product(x, cos[i])) + detail::to_float(rounded_product(rotated, sin[i]));
        out[i] = detail::from_float<T>(sum);
    }
}

}  // namespace

cudaError_t rotary(const RotaryParams& params, cudaStream_t stream) {
    const int64_t rows = static_cast<int64_t>(params.num_heads + params.num_kv_heads) * params.num_tokens;
    if (rows == 0) return cudaSuccess;  // nothing to do (an empty tensor's pointer is null)
    if (params.query == nullptr || params.key == nullptr || params.cos == nullptr || params.sin == nullptr ||
        params.query_out == nullptr || params.key_out == nullptr || params.head_dim <= 0 ||
        params.head_dim % 2 != 0 || params.num_tokens < 0) {
        return cudaErrorInvalidValue;
    }
    const int blocks = detail::ceil_div(rows, kRowsPerBlock);
    if (params.dtype == DataType::kFloat16) {
        rotary_kernel<__half><<<blocks, kRotaryThreads, 0, stream>>>(params);
    } else {
        rotary_kernel<__nv_bfloat16><<<blocks, kRotaryThreads, 0, stream>>>(params);
    }
    return cudaGetLastError();
}

}  // namespace tokenswift
