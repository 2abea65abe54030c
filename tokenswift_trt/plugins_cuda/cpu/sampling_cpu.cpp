// CPU implementation of the sampling step shared by AR decoding and TokenSwift verification
// (model/sampling.py): per row, the contextual penalty over a window of token ids, temperature,
// min-p (keeping at least `keep` tokens), then the `width` best tokens of score + Gumbel noise
// (width 1: the sample; more: a draft's ranking). Greedy rows take the penalised logits as they
// are. One pass over the vocabulary per stage in plain loops, instead of a dozen tensor operations
// each with its own dispatch: for an 8K vocabulary that is the difference between ~0.3 ms and a
// few µs per row, paid once per AR token and once per TokenSwift iteration.
//
// Same semantics as the PyTorch path (process_logits, then gumbel_max_rows or draft_ranking),
// with one documented difference: where tokens tie with the keep-th best score, all of them stay
// (topk keeps an arbitrary subset). Compiled with -ffast-math like the attention kernel, so no
// infinities are used: excluded tokens are skipped, not set to -inf, and a score divided by θ or
// the temperature may differ from PyTorch's in the last bit. AR and TokenSwift call the same code,
// so with one seed they still emit the same tokens.
//
// Noise comes as rows [N, V] of float64, or as one int64 key per row (the key of a position,
// runtime/sampling.PositionKeyedRandom.keys): the row's noise is then computed here, and only for
// the tokens min-p keeps (a few dozen of SmolLM2's 49,152), by position_gumbel's definition
// (splitmix64 of index ^ key -> a uniform in (0, 1) -> -log(-log(u))). The integer part is exact;
// the logarithms are glibc's, which may differ from PyTorch's vectorised ones in the last bit.
// Computing a whole row of noise in tensor operations cost ~0.8 ms per position on a 2-core EPYC
// (~3.5% of a SmolLM2 step), for every AR token and every position a TokenSwift iteration commits.
#include "kernels_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// splitmix64's finaliser (runtime/sampling._splitmix64), arithmetic mod 2^64
inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// The Gumbel noise of token `index` under a position's key (runtime/sampling.keyed_uniform_rows,
// then -log(-log(u))): the top 53 bits of the hash as a uniform in (0, 1), exactly as there.
inline double keyed_gumbel(uint64_t key, int64_t index) {
    const uint64_t bits = splitmix64(static_cast<uint64_t>(index) ^ key);
    const double uniform = (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
    return -std::log(-std::log(uniform));
}

// One row's noise: none (greedy), a row of V values, or computed from a key where asked for.
struct RowNoise {
    const double* row = nullptr;
    bool keyed = false;
    uint64_t key = 0;
    double at(int64_t index) const { return row != nullptr ? row[index] : keyed ? keyed_gumbel(key, index) : 0.0; }
};

struct Ranked {
    double value;
    int64_t index;
};

// Insert (value, index) into best[0 .. count) (sorted, best first; ties keep the lower index first).
inline void offer(Ranked* best, int64_t& count, int64_t width, double value, int64_t index) {
    if (count == width && !(value > best[count - 1].value)) return;
    int64_t position = count < width ? count++ : width - 1;
    while (position > 0 && value > best[position - 1].value) {
        best[position] = best[position - 1];
        --position;
    }
    best[position] = Ranked{value, index};
}

void rank_row(const float* logits, const int64_t* window, int64_t window_size, const RowNoise& noise, int64_t vocab,
              float penalty, bool greedy, float temperature, float log_min_p, int64_t keep, int64_t width,
              int64_t* out, std::vector<float>& scores, std::vector<float>& top) {
    scores.assign(logits, logits + vocab);
    if (penalty != 1.0f) {
        for (int64_t i = 0; i < window_size; ++i) {
            const int64_t id = window[i];
            const float original = logits[id];  // from the logits: a repeated id is penalised once
            scores[id] = penalised_logit(original, penalty);
        }
    }
    float cut = 0.0f;
    bool truncated = false;
    if (!greedy) {
        if (temperature != 1.0f) {
            for (int64_t i = 0; i < vocab; ++i) scores[i] = scores[i] / temperature;
        }
        if (keep > 0) {  // min-p: s >= max + log(min_p), and never fewer than `keep` tokens
            // one pass keeps the `keep` best scores (sorted, best first): top[0] is the maximum,
            // and the cut is the lower of the min-p threshold and the keep-th best score
            const int64_t kept = std::min(keep, vocab);
            top.assign(kept, 0.0f);
            int64_t filled = 0;
            for (int64_t i = 0; i < vocab; ++i) {
                const float value = scores[i];
                if (filled == kept && !(value > top[kept - 1])) continue;
                int64_t position = filled < kept ? filled++ : kept - 1;
                while (position > 0 && value > top[position - 1]) {
                    top[position] = top[position - 1];
                    --position;
                }
                top[position] = value;
            }
            cut = std::min(top[0] + log_min_p, top[kept - 1]);
            truncated = true;
        }
    }
    Ranked best[64];
    int64_t count = 0;
    for (int64_t i = 0; i < vocab; ++i) {
        if (truncated && scores[i] < cut) continue;
        const double value = static_cast<double>(scores[i]) + noise.at(i);
        offer(best, count, width, value, i);
    }
    for (int64_t r = 0; r < width; ++r) out[r] = r < count ? best[r].index : best[0].index;
}

}  // namespace

at::Tensor gumbel_topk_cpu(const at::Tensor& logits, const at::Tensor& windows, const at::Tensor& noise,
                           double penalty, bool greedy, double temperature, double log_min_p, int64_t keep,
                           int64_t width) {
    TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                    logits.is_contiguous(),
                "logits must be a contiguous float32 CPU tensor [N, V]");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    TORCH_CHECK(vocab > 0, "logits must have a vocabulary");
    TORCH_CHECK(width >= 1 && width <= 64 && width <= vocab, "width must be in [1, min(64, V)], got ", width);
    TORCH_CHECK(windows.scalar_type() == at::kLong && windows.dim() == 2 && windows.is_contiguous() &&
                    (windows.size(0) == 1 || windows.size(0) == rows),
                "windows must be a contiguous int64 tensor [1 or N, W]");
    const bool noisy = noise.numel() > 0;
    const bool keyed = noisy && noise.scalar_type() == at::kLong;
    TORCH_CHECK(!noisy || (noise.is_contiguous() &&
                           (keyed ? noise.dim() == 1 && noise.size(0) == rows
                                  : noise.scalar_type() == at::kDouble && noise.dim() == 2 && noise.size(0) == rows &&
                                        noise.size(1) == vocab)),
                "noise must be empty, a contiguous float64 tensor [N, V] or int64 keys [N]");
    TORCH_CHECK(penalty >= 1.0, "penalty must be >= 1");
    TORCH_CHECK(greedy || temperature > 0.0, "temperature must be > 0 unless greedy");
    const int64_t window_size = windows.size(1);
    const int64_t* window_data = windows.data_ptr<int64_t>();
    for (int64_t i = 0; i < windows.numel(); ++i) {
        TORCH_CHECK(window_data[i] >= 0 && window_data[i] < vocab, "window ids must be in [0, V)");
    }
    at::Tensor out = at::empty({rows, width}, logits.options().dtype(at::kLong));
    const float* logit_data = logits.data_ptr<float>();
    const double* noise_rows = noisy && !keyed ? noise.data_ptr<double>() : nullptr;
    const int64_t* noise_keys = keyed ? noise.data_ptr<int64_t>() : nullptr;
    int64_t* out_data = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, top;
        for (int64_t row = begin; row < end; ++row) {
            const int64_t* window = window_data + (windows.size(0) == 1 ? 0 : row) * window_size;
            RowNoise row_noise;
            if (noise_rows != nullptr) row_noise.row = noise_rows + row * vocab;
            if (keyed) {
                row_noise.keyed = true;
                row_noise.key = static_cast<uint64_t>(noise_keys[row]);
            }
            rank_row(logit_data + row * vocab, window, window_size, row_noise, vocab,
                     static_cast<float>(penalty), greedy, static_cast<float>(temperature),
                     static_cast<float>(log_min_p), keep, width, out_data + row * width, scores, top);
        }
    });
    return out;
}
