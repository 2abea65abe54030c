// Float32 linear layers for CPU decoding and verification: y[M, N] = x[M, K] · Wᵀ + b, made for the few
// rows of an AR step (M = 1) and a tree verification (M = 2..16 nodes); a prompt's M rows work too.
//
// Why not oneDNN: a decoder's weights stream from memory at every step, so one row costs one read
// of the weights, and oneDNN's packed layout streamed them ~1.5x slower than this kernel on SmolLM2's
// shapes (2-core AMD EPYC). Here each weight vector, once loaded, is used for a tile of rows (4 on
// AVX2, 8 on AVX-512) from registers and for the other tiles from L1 (24 KB of weights at a time),
// so a few rows cost about one read of the weights; beyond that the arithmetic of 2 cores is the
// limit (docs/runtime.md, "On a CPU").
//
// Batch invariance: every output element is one chain of fused multiply-adds over k = 0 .. K-1 in
// order, whatever M is, however the rows are tiled and however the outputs are split over threads.
// A token's logits are therefore the same bits in an AR step (M = 1) and in a verification (M = T):
// speculation cannot change a near-tie, so TokenSwift's tokens equal AR's by construction, not only
// in practice.
//
// Weight layout (pack_linear_cpu): [ceil(N / W), K, W]: blocks of W = 3 vectors of outputs (48 on
// AVX-512, 24 on AVX2), each k's W weights contiguous, so the first row tile streams a block front to
// back (what the hardware prefetcher follows best); the last block is zero-padded. The layout is the
// compiling machine's (-march=native): packed weights are made at load time, never stored.
//
// Half-precision weights (pack_linear_half_cpu): the same layout in float16, widened to float32 as
// they are loaded (F16C), the arithmetic float32 as above. Half the bytes to stream, for products
// whose rounding only changes proposals: the draft layers' (a one-row draft pass of SmolLM2's heads
// reads ~36 MB in float32). y is then exactly the float32 kernel's y for the weight rounded to float16.
#include "kernels_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// One register type per instruction set: AVX-512 (32 registers of 16 floats) takes 8-row tiles,
// AVX2 (16 registers of 8) 4-row tiles; both 3 vectors wide, so a tile is R x 3 independent chains
// of fused multiply-adds (24 or 12), enough to hide their latency with the weights and the
// broadcast input still in registers.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kVector = 16;   // floats per register
constexpr int64_t kTileRows = 8;  // 8 x 3 = 24 accumulators of 32 registers
constexpr int64_t kDepth = 128;   // k per pass: a block's 128 x 48 weights (24 KB) stay in L1
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec splat(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#define TOKENSWIFT_VECTOR_TILES 1
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kVector = 8;
constexpr int64_t kTileRows = 4;  // 4 x 3 = 12 accumulators of 16 registers
constexpr int64_t kDepth = 256;   // 256 x 24 weights: 24 KB
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec splat(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#define TOKENSWIFT_VECTOR_TILES 1
#else
constexpr int64_t kVector = 8;
constexpr int64_t kTileRows = 4;
constexpr int64_t kDepth = 256;
#endif
constexpr int64_t kColumns = 3;                  // vectors per block
constexpr int64_t kWidth = kColumns * kVector;   // outputs per block: 48 (AVX-512) or 24
constexpr int64_t kLine = 64;                    // bytes per cache line
constexpr int64_t kAhead = 2;                    // passes ahead that multi-tile calls prefetch

#if defined(TOKENSWIFT_VECTOR_TILES)
// acc[R][kWidth] += x[R][k0:k1] · w[k0:k1][kWidth]  (W: float, or uint16_t holding float16 bits)
template <int R, typename W>
inline void tile(const float* x, int64_t x_stride, const W* w, int64_t k0, int64_t k1, float* acc,
                 const char* ahead, int64_t share, int64_t shares) {
    Vec sum[R][kColumns];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < kColumns; ++c) sum[r][c] = load(acc + r * kWidth + c * kVector);
    // `ahead`: a later pass's weights, of which this tile prefetches every `shares`-th k from `share`
    int64_t turn = share;  // counts down to this tile's next k to prefetch
    for (int64_t k = k0; k < k1; ++k) {
        if (ahead != nullptr && turn == 0)
            for (int64_t offset = 0; offset < kWidth * int64_t(sizeof(W)); offset += kLine)
                _mm_prefetch(ahead + (k - k0) * kWidth * int64_t(sizeof(W)) + offset, _MM_HINT_T1);
        turn = (turn == 0 ? shares : turn) - 1;
        // the three weight vectors as named values, not an array: with an array GCC kept AVX2's 4-row
        // tile (12 accumulators, all 16 registers in use) in registers but also stored all 12 to the
        // stack at every k, and 4 rows cost 1.16x one row instead of 1.00x (SmolLM2's layers, 2 cores)
        static_assert(kColumns == 3, "the tile names its three weight vectors");
        const Vec w0 = load(w + k * kWidth), w1 = load(w + k * kWidth + kVector);
        const Vec w2 = load(w + k * kWidth + 2 * kVector);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const Vec value = splat(x + r * x_stride + k);
            sum[r][0] = vfma(value, w0, sum[r][0]);
            sum[r][1] = vfma(value, w1, sum[r][1]);
            sum[r][2] = vfma(value, w2, sum[r][2]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < kColumns; ++c) store(acc + r * kWidth + c * kVector, sum[r][c]);
}
#else
// Portable version: the same chain of fused multiply-adds per output element.
inline float widen(float value) { return value; }
inline float widen(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

template <int R, typename W>
inline void tile(const float* x, int64_t x_stride, const W* w, int64_t k0, int64_t k1, float* acc,
                 const char*, int64_t, int64_t) {
    for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < kWidth; ++j) {
            float sum = acc[r * kWidth + j];
            for (int64_t k = k0; k < k1; ++k) sum = std::fma(x[r * x_stride + k], widen(w[k * kWidth + j]), sum);
            acc[r * kWidth + j] = sum;
        }
}
#endif

template <typename W>
inline void tile_rows(int64_t rows, const float* x, int64_t x_stride, const W* w, int64_t k0, int64_t k1,
                      float* acc, const char* ahead, int64_t share, int64_t shares) {
    switch (rows) {
        case 1: return tile<1>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 2: return tile<2>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 3: return tile<3>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 4: return tile<4>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 5: return tile<5>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 6: return tile<6>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        case 7: return tile<7>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
        default: return tile<8>(x, x_stride, w, k0, k1, acc, ahead, share, shares);
    }
}

// y[rows, outputs] = x · packed (+ bias), packed [blocks, depth, kWidth] of W
template <typename W>
void run_linear(const float* x_data, int64_t rows, int64_t depth, const W* w_data, int64_t blocks,
                const float* b_data, int64_t outputs, float* out_data) {
    // balanced row tiles of at most kTileRows (6 rows on AVX2: 3 + 3, not 4 + 2: a small tile has too
    // few chains)
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> sums(rows * kWidth);
        float* acc = sums.data();
        for (int64_t block = begin; block < end; ++block) {
            std::fill(acc, acc + rows * kWidth, 0.0f);
            const W* w = w_data + block * depth * kWidth;
            for (int64_t k0 = 0; k0 < depth; k0 += kDepth) {
                const int64_t k1 = std::min(depth, k0 + kDepth);
                // the first tile streams this pass's weights from memory; the ones after it read
                // them from L1 and make no memory traffic of their own. So the tiles share out
                // prefetches into L2 of the pass two ahead in the stream (~48 KB on in float32: this
                // block's later k, or the next blocks), a k at a time each, keeping the memory busy
                // through all of them. Prefetching only the next pass, only from the second tile,
                // into L1 leaves it idle while the first tile works: 5 and 8 rows of SmolLM2's 30
                // layers cost 1.25x and 1.59x one row on the 2-core AVX2 EPYC that way, 1.09x and
                // 1.33x with this. A single tile prefetches too: left to the hardware prefetcher, 4
                // rows cost 1.40x one row on the 2-core AVX-512 Xeon (a tile's longer multiply-add
                // work per k outruns it), 1.06x with prefetches (docs/runtime.md).
                const char* later = reinterpret_cast<const char*>(w + (k0 + kAhead * kDepth) * kWidth);
                for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
                    const int64_t count = (rows - r0) / (tiles - t);
                    tile_rows(count, x_data + r0 * depth, depth, w, k0, k1, acc + r0 * kWidth, later, t, tiles);
                    r0 += count;
                }
            }
            const int64_t first = block * kWidth, width = std::min(kWidth, outputs - first);
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < width; ++j)
                    out_data[r * outputs + first + j] = acc[r * kWidth + j] + (b_data ? b_data[first + j] : 0.0f);
        }
    });
}

}  // namespace

// Zeros [sizes] of `dtype` on memory mapped for it alone and advised onto 2 MB pages (MADV_HUGEPAGE
// before the first touch; Linux with transparent huge pages in "madvise" or "always" mode, else plain
// pages): a weight or K/V cache streamed at every step then crosses a page boundary every 2 MB instead
// of every 4 KB, which on the 2-core EPYC made SmolLM2's 30 layers' products ~8% faster (one row 15.4
// -> 14.2 ms, four 16.9 -> 15.4) and a 4-token verify's attention over 4,096 cached keys 14.7 -> 13.5.
// Its own mapping (not the allocator's, which may hand back heap memory already touched on 4 KB
// pages), 2 MB longer, the tensor starting on a 2 MB boundary; pages are faulted in as they are first
// written (the untouched slack and unused capacity cost address space only). Below 2 MB or elsewhere:
// at::zeros (callers that do not want huge pages call at::zeros themselves: the kernel setting huge_pages).
at::Tensor zeros_on_huge_pages_cpu(at::IntArrayRef sizes, at::ScalarType dtype) {
    constexpr int64_t kHugePage = int64_t(2) << 20;
    const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    int64_t count = 1;
    for (const int64_t size : sizes) count *= size;
    const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
    if (bytes < kHugePage) return at::zeros(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const size_t length = static_cast<size_t>(bytes + kHugePage);
    void* mapping = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) return at::zeros(sizes, options);
    const auto address = reinterpret_cast<uintptr_t>(mapping);
    const uintptr_t start = (address + kHugePage - 1) / kHugePage * kHugePage;
    madvise(reinterpret_cast<void*>(start), static_cast<size_t>(bytes + kHugePage - (start - address)) / kHugePage * kHugePage,
            MADV_HUGEPAGE);  // advice: a refusal leaves ordinary pages
    return at::from_blob(
        reinterpret_cast<void*>(start), sizes, [mapping, length](void*) { munmap(mapping, length); }, options);
#else
    return at::zeros(sizes, options);
#endif
}

namespace {

// weight [out, in] (float32) -> [ceil(out / kWidth), in, kWidth] of `dtype` (float32 or float16)
at::Tensor pack(const at::Tensor& weight, at::ScalarType dtype, bool huge_pages) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
                "pack_linear: weight must be a float32 CPU matrix [out, in]");
    const at::Tensor source = weight.contiguous();
    const int64_t outputs = source.size(0), depth = source.size(1);
    const int64_t blocks = (outputs + kWidth - 1) / kWidth;
    at::Tensor packed = dtype == at::kFloat && huge_pages
                            ? zeros_on_huge_pages_cpu({blocks, depth, kWidth}, at::kFloat)
                            : at::zeros({blocks, depth, kWidth}, source.options());
    const float* from = source.data_ptr<float>();
    float* to = packed.data_ptr<float>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t block = begin; block < end; ++block) {
            const int64_t width = std::min(kWidth, outputs - block * kWidth);
            for (int64_t j = 0; j < width; ++j) {
                const float* row = from + (block * kWidth + j) * depth;
                for (int64_t k = 0; k < depth; ++k) to[(block * depth + k) * kWidth + j] = row[k];
            }
        }
    });
    if (dtype == at::kFloat) return packed;
    at::Tensor narrow = huge_pages ? zeros_on_huge_pages_cpu({blocks, depth, kWidth}, dtype)
                                   : at::zeros({blocks, depth, kWidth}, source.options().dtype(dtype));
    narrow.copy_(packed);
    return narrow;
}

}  // namespace

at::Tensor pack_linear_cpu(const at::Tensor& weight, bool huge_pages) { return pack(weight, at::kFloat, huge_pages); }

at::Tensor pack_linear_half_cpu(const at::Tensor& weight, bool huge_pages) {
    return pack(weight, at::kHalf, huge_pages);
}

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& bias, int64_t outputs) {
    TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat && input.dim() == 2,
                "linear: input must be a float32 CPU matrix [rows, in]");
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == input.size(1) && packed.size(2) == kWidth &&
                    packed.size(0) * kWidth >= outputs && packed.is_contiguous(),
                "linear: packed weight does not match the input (pack it with pack_linear)");
    TORCH_CHECK(packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kHalf,
                "linear: packed weight must be float32 or float16 (pack_linear / pack_linear_half)");
    const bool has_bias = bias.defined() && bias.numel() > 0;
    TORCH_CHECK(!has_bias || (bias.numel() == outputs && bias.scalar_type() == at::kFloat),
                "linear: bias must be float32 [out]");
    const at::Tensor x = input.contiguous();
    const int64_t rows = x.size(0), depth = x.size(1), blocks = packed.size(0);
    at::Tensor out = at::empty({rows, outputs}, x.options());
    const at::Tensor b = has_bias ? bias.contiguous() : at::Tensor();
    const float* b_data = has_bias ? b.data_ptr<float>() : nullptr;
    if (rows == 0) return out;
    if (packed.scalar_type() == at::kHalf)
        run_linear(x.data_ptr<float>(), rows, depth, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>()),
                   blocks, b_data, outputs, out.data_ptr<float>());
    else
        run_linear(x.data_ptr<float>(), rows, depth, packed.data_ptr<float>(), blocks, b_data, outputs,
                   out.data_ptr<float>());
    return out;
}
