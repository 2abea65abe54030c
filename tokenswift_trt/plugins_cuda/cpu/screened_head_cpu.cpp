// The target's LM head for sampling, exact where sampling can look and screened elsewhere: logits of a
// few rows x [R, K] through a head W [V, K] whose float32 product is the tiled kernel's (linear_cpu).
//
// Why: SmolLM2-135M's head is 49,152 x 576, a fifth of the model's weights, and every AR step and
// every verification reads all of it to sample one token per row. Under min-p (or greedy) sampling
// only a few dozen tokens per row can be drawn; the rest are cut before the draw. So the head is
// first read in float16 (half the bytes; pack_linear_half), each logit then known within a bound,
// and only the tokens whose bound reaches the row's cut are computed again in float32, by the same
// kernel on the same weights: those logits are the same bits as the full head's (every output is one
// in-order chain of fused multiply-adds over k, whichever rows and columns share the call). Every
// other token gets kScreened, a finite score below anything real, which the sampler's penalty,
// temperature and min-p cut (model/sampling.py; sampling_cpu.cpp) leave below the cut. The sampled
// token is therefore the one the full head gives, always, not just almost surely.
//
// The bound: with h = float16(w) and s = x · h as the screen computes it (one float32 chain),
//   |x · w (float32 chain) - s| <= ||x||_2 (||w - h||_2 + gamma_K (||w||_2 + ||h||_2)),
// gamma_K = K u / (1 - K u), u = 2^-24 (the rounding of each chain, Higham's bound, which holds for
// fused multiply-adds). `bounds` holds the parenthesis per row of W (model/screened_head.py, in
// float64, rounded up); here it is scaled by ||x||_2 per row.
//
// The cut, per row, in penalised-logit space (penalty p(z) = z / θ above 0, z θ below: increasing):
// sampling keeps token i when p(z_i) / T >= min(max / T + log min_p, keep-th best / T), i.e.
// p(z_i) >= min(max + T log min_p, keep-th best); greedy takes the maximum. Lower bounds of the
// penalised logits give lower bounds of the maximum and of the keep-th best, so a token whose upper
// bound is below that cut cannot be kept (nor be the argmax). A small margin covers the float32
// rounding of the sampler's own arithmetic.
#include "kernels_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr float kScreened = -1.0e30f;  // the score of a screened-out token (finite: -ffast-math)

// Inserts `value` into top[0 .. size) (sorted, best first) if it beats the last.
inline void offer(float* top, int64_t size, float value) {
    if (!(value > top[size - 1])) return;
    int64_t position = size - 1;
    while (position > 0 && value > top[position - 1]) {
        top[position] = top[position - 1];
        --position;
    }
    top[position] = value;
}

// Appends to `chosen` the tokens of one row that sampling could keep (see above), ascending. Two
// passes over the row, nothing stored per token: the lower bounds' maximum and keep-th best (window
// tokens apart, penalised), then the tokens whose upper bound reaches the cut.
void choose_row(const float* screen, const float* bounds, int64_t vocab, double x_norm, const int64_t* window,
                int64_t window_size, float penalty, bool greedy, double temperature, double log_min_p, int64_t keep,
                std::vector<uint8_t>& in_window, std::vector<int64_t>& chosen) {
    // bounds scaled up a little, so that the float32 arithmetic below can only widen them
    const float scale = static_cast<float>(x_norm * (1.0 + 1e-5));
    const int64_t kept = greedy ? 1 : std::min(keep, vocab);
    std::vector<float> top(kept, -3.0e38f);
    const bool penalised_window = penalty != 1.0f && window_size > 0;
    if (penalised_window)
        for (int64_t i = 0; i < window_size; ++i) in_window[window[i]] = 1;
    // the tokens whose lower bound beats the current keep-th best (few, once it settles), 8 at a time
    // where AVX2 is compiled in: one compare for 8 tokens instead of one per token
    const auto lower = [&](int64_t j) { return screen[j] - scale * bounds[j] - 1e-6f; };
    const auto consider = [&](int64_t j) {
        if (!(penalised_window && in_window[j])) offer(top.data(), kept, lower(j));
    };
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 minus_scale = _mm256_set1_ps(-scale), epsilon = _mm256_set1_ps(1e-6f);
    for (; j + 8 <= vocab; j += 8) {
        const __m256 bound = _mm256_fmadd_ps(minus_scale, _mm256_loadu_ps(bounds + j), _mm256_loadu_ps(screen + j));
        const __m256 above = _mm256_cmp_ps(_mm256_sub_ps(bound, epsilon), _mm256_set1_ps(top[kept - 1]), _CMP_GT_OQ);
        for (int bits = _mm256_movemask_ps(above); bits != 0; bits &= bits - 1) consider(j + __builtin_ctz(bits));
    }
#endif
    for (; j < vocab; ++j) consider(j);
    if (penalised_window)
        for (int64_t i = 0; i < window_size; ++i) {
            const int64_t id = window[i];
            if (!in_window[id]) continue;  // a repeated id once
            in_window[id] = 0;
            offer(top.data(), kept, penalised_logit(screen[id] - scale * bounds[id] - 1e-6f, penalty));
        }
    double cut = top[0];
    if (!greedy) cut = std::min(cut + temperature * log_min_p, static_cast<double>(top[kept - 1]));
    const float threshold = static_cast<float>(cut - (1e-3 + 1e-5 * std::fabs(cut)));
    // upper bounds without the penalty: only ever higher than with it, so a superset is chosen
    j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 plus_scale = _mm256_set1_ps(scale), floor = _mm256_set1_ps(threshold - 1e-6f);
    for (; j + 8 <= vocab; j += 8) {
        const __m256 bound = _mm256_fmadd_ps(plus_scale, _mm256_loadu_ps(bounds + j), _mm256_loadu_ps(screen + j));
        for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(bound, floor, _CMP_GE_OQ)); bits != 0; bits &= bits - 1)
            chosen.push_back(j + __builtin_ctz(bits));
    }
#endif
    for (; j < vocab; ++j)
        if (screen[j] + scale * bounds[j] + 1e-6f >= threshold) chosen.push_back(j);
}

}  // namespace

at::Tensor screened_logits_cpu(const at::Tensor& x, const at::Tensor& half_packed, const at::Tensor& bounds,
                               const at::Tensor& weight, const at::Tensor& windows, double penalty, bool greedy,
                               double temperature, double log_min_p, int64_t keep) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
                "screened head: x must be a contiguous float32 CPU matrix [R, K]");
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                    weight.size(1) == x.size(1),
                "screened head: weight must be a contiguous float32 matrix [V, K] matching x");
    const int64_t rows = x.size(0), vocab = weight.size(0);
    TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.numel() == vocab && bounds.is_contiguous(),
                "screened head: bounds must be float32 [V]");
    TORCH_CHECK(windows.scalar_type() == at::kLong && windows.dim() == 2 && windows.is_contiguous() &&
                    (windows.size(0) == 1 || windows.size(0) == rows),
                "screened head: windows must be a contiguous int64 tensor [1 or R, W]");
    TORCH_CHECK(penalty >= 1.0, "screened head: penalty must be >= 1");
    TORCH_CHECK(greedy || (temperature > 0.0 && keep >= 1 && log_min_p < 0.0),
                "screened head: sampling must be greedy or truncated by min-p (keep >= 1)");
    const int64_t window_size = windows.size(1);
    const int64_t* window_data = windows.data_ptr<int64_t>();
    for (int64_t i = 0; i < windows.numel(); ++i)
        TORCH_CHECK(window_data[i] >= 0 && window_data[i] < vocab, "screened head: window ids must be in [0, V)");

    const at::Tensor none = x.new_empty(0);
    const at::Tensor screen = linear_cpu(x, half_packed, none, vocab);  // [R, V], float16 weights
    std::vector<std::vector<int64_t>> chosen(rows);
    const float* screen_data = screen.data_ptr<float>();
    const float* x_data = x.data_ptr<float>();
    const int64_t depth = x.size(1);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint8_t> in_window(vocab, 0);
        for (int64_t r = begin; r < end; ++r) {
            double squares = 0.0;
            for (int64_t k = 0; k < depth; ++k) squares += static_cast<double>(x_data[r * depth + k]) * x_data[r * depth + k];
            choose_row(screen_data + r * vocab, bounds.data_ptr<float>(), vocab, std::sqrt(squares),
                       window_data + (windows.size(0) == 1 ? 0 : r) * window_size, window_size,
                       static_cast<float>(penalty), greedy, temperature, log_min_p, keep, in_window, chosen[r]);
        }
    });
    std::vector<int64_t> ids;  // the union over rows, ascending
    for (const auto& row : chosen) ids.insert(ids.end(), row.begin(), row.end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    const at::Tensor index = at::empty({static_cast<int64_t>(ids.size())}, x.options().dtype(at::kLong));
    std::copy(ids.begin(), ids.end(), index.data_ptr<int64_t>());
    // the chosen tokens again in float32: the same kernel, the same weights, the same bits
    const at::Tensor exact = linear_cpu(x, pack_linear_cpu(at::index_select(weight, 0, index)), none,
                                        static_cast<int64_t>(ids.size()));  // [R, C]
    at::Tensor out = at::full({rows, vocab}, kScreened, x.options());
    float* out_data = out.data_ptr<float>();
    const float* exact_data = exact.data_ptr<float>();
    const int64_t count = static_cast<int64_t>(ids.size());
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < count; ++c) out_data[r * vocab + ids[c]] = exact_data[r * count + c];
    return out;
}
