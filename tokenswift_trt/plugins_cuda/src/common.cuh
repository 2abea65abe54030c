// Small device helpers shared by the kernels: element conversion, warp sums, sizes and alignment.
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

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

inline bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

}  // namespace detail
}  // namespace tokenswift
