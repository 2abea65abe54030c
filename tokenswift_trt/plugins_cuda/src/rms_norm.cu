// Residual add + RMSNorm in one kernel: what a decoder layer does twice between its matrix products
// (x = x + attention; h = norm(x); x = x + mlp; h' = next_norm(x)), in one pass over the row instead
// of PyTorch's eight small kernels (add, cast, square, mean, add eps, rsqrt, multiply, cast, scale).
//
// Rounding follows the PyTorch composition it replaces (model/decoder.py RMSNorm on fp16/bf16):
// the sum is rounded to the element type (PyTorch's add); the mean of squares of that rounded sum is
// taken in fp32; x * rsqrt(mean + eps) is rounded to the element type, then scaled by the weight in
// fp32 and rounded again (PyTorch's half-precision multiply). Only the order of the fp32 sum of
// squares differs, so the normalised value can differ from PyTorch's in its last bit (and the
// output, after the weight's product, by up to two units in the last place).
//
// One block per row; rows are independent, so a row's outputs are the same bits whatever the row
// count (an AR step's one row and a verify's 64 agree).
#include "common.cuh"

namespace tokenswift {
namespace {

constexpr int kNormThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ delta, const T* __restrict__ weight,
                        T* __restrict__ sum_out, T* __restrict__ normed, int32_t hidden, float eps) {
    const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
    const T* row = x + offset;
    const T* add = delta == nullptr ? nullptr : delta + offset;
    T* sum_row = sum_out + offset;
    T* out_row = normed + offset;

    float squares = 0.0f;
    for (int32_t i = threadIdx.x; i < hidden; i += kNormThreads) {
        float value = detail::to_float(row[i]);
        if (add != nullptr) value += detail::to_float(add[i]);
        const T rounded = detail::from_float<T>(value);
        sum_row[i] = rounded;
        const float kept = detail::to_float(rounded);
        squares += kept * kept;
    }

    __shared__ float partial[kNormThreads / 32];
    __shared__ float scale;
    squares = detail::warp_sum(squares);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = squares;
    __syncthreads();
    if (warp == 0) {
        float total = lane < kNormThreads / 32 ? partial[lane] : 0.0f;
        total = detail::warp_sum(total);
        // PyTorch's mean multiplies the sum by 1/N, and adds eps in a kernel of its own: no fused
        // multiply-add here, or the rounding would differ
        if (lane == 0) scale = rsqrtf(__fadd_rn(__fmul_rn(total, 1.0f / static_cast<float>(hidden)), eps));
    }
    __syncthreads();

    for (int32_t i = threadIdx.x; i < hidden; i += kNormThreads) {
        // this thread wrote sum_row[i] above: its own write, no barrier needed to read it back
        const T unit = detail::from_float<T>(detail::to_float(sum_row[i]) * scale);
        out_row[i] = detail::from_float<T>(detail::to_float(unit) * detail::to_float(weight[i]));
    }
}

template <typename T>
cudaError_t launch(const RmsNormParams& params, cudaStream_t stream) {
    add_rms_norm_kernel<T><<<params.rows, kNormThreads, 0, stream>>>(
        static_cast<const T*>(params.x), static_cast<const T*>(params.delta),
        static_cast<const T*>(params.weight), static_cast<T*>(params.sum_out), static_cast<T*>(params.normed),
        params.hidden, params.eps);
    return cudaGetLastError();
}

}  // namespace

cudaError_t add_rms_norm(const RmsNormParams& params, cudaStream_t stream) {
    if (params.rows == 0) return cudaSuccess;  // nothing to do (an empty tensor's pointer is null)
    if (params.rows < 0 || params.hidden <= 0 || params.x == nullptr || params.weight == nullptr ||
        params.sum_out == nullptr || params.normed == nullptr) {
        return cudaErrorInvalidValue;
    }
    return params.dtype == DataType::kFloat16 ? launch<__half>(params, stream) : launch<__nv_bfloat16>(params, stream);
}

}  // namespace tokenswift
