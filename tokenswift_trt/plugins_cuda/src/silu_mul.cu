// SiLU(gate) * up over an MLP's packed gate-up product in one kernel (PyTorch: silu, then a product).
//
// gate_up [rows, 2 * inner] holds gate in its first half and up in its second; out [rows, inner].
// Rounding follows PyTorch's fp16/bf16 ops: silu(g) = g / (1 + exp(-g)) in fp32, rounded to the
// element type, then the product in fp32, rounded: elementwise, so the same bits as the composition.
#include <algorithm>

#include "common.cuh"

namespace tokenswift {
namespace {

constexpr int kSiluThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kSiluThreads)
    silu_mul_kernel(const T* __restrict__ gate_up, T* __restrict__ out, int64_t rows, int32_t inner) {
    const int64_t total = rows * inner;
    for (int64_t index = static_cast<int64_t>(blockIdx.x) * kSiluThreads + threadIdx.x; index < total;
         index += static_cast<int64_t>(gridDim.x) * kSiluThreads) {
        const int64_t row = index / inner;
        const int64_t column = index % inner;
        const float gate = detail::to_float(gate_up[row * 2 * inner + column]);
        const T activated = detail::from_float<T>(gate / (1.0f + expf(-gate)));
        const float up = detail::to_float(gate_up[row * 2 * inner + inner + column]);
        out[index] = detail::from_float<T>(detail::to_float(activated) * up);
    }
}

template <typename T>
cudaError_t launch(const SiluMulParams& params, cudaStream_t stream) {
    const int64_t total = static_cast<int64_t>(params.rows) * params.inner;
    const int blocks = static_cast<int>(std::min<int64_t>(detail::ceil_div(total, kSiluThreads), 65535));
    silu_mul_kernel<T><<<blocks, kSiluThreads, 0, stream>>>(static_cast<const T*>(params.gate_up),
                                                            static_cast<T*>(params.out), params.rows, params.inner);
    return cudaGetLastError();
}

}  // namespace

cudaError_t silu_mul(const SiluMulParams& params, cudaStream_t stream) {
    if (params.rows == 0) return cudaSuccess;  // nothing to do (an empty tensor's pointer is null)
    if (params.gate_up == nullptr || params.out == nullptr || params.rows < 0 || params.inner <= 0) {
        return cudaErrorInvalidValue;
    }
    return params.dtype == DataType::kFloat16 ? launch<__half>(params, stream) : launch<__nv_bfloat16>(params, stream);
}

}  // namespace tokenswift
