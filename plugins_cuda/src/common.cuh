// Small device helpers shared by the kernels: element conversion and 16-byte row copies.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tokenswift_kernels.h"

namespace tokenswift {
namespace detail {

template <typename T>
__device__ __forceinline__ float to_float(T value);

template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }

template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);

template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }

// 16-bit elements per 16-byte vector.
constexpr int kVector = 8;

// Copy `rows` rows of `head_dim` 16-bit elements (global rows `row_stride` elements apart) into
// shared memory rows `smem_stride` elements apart; rows in [valid, rows) are zero-filled.
// Every thread of the block takes part.
template <typename T>
__device__ __forceinline__ void load_rows(T* smem, int smem_stride, const T* global, int64_t row_stride, int rows,
                                          int valid, int head_dim) {
    const int vectors_per_row = head_dim / kVector;
    for (int item = threadIdx.x; item < rows * vectors_per_row; item += blockDim.x) {
        const int row = item / vectors_per_row;
        const int column = (item % vectors_per_row) * kVector;
        uint4 data = make_uint4(0, 0, 0, 0);
        if (row < valid) {
            data = *reinterpret_cast<const uint4*>(global + row * row_stride + column);
        }
        *reinterpret_cast<uint4*>(smem + row * smem_stride + column) = data;
    }
}

__device__ __forceinline__ float warp_max(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

inline bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace detail
}  // namespace tokenswift
