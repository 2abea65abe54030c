// CPU implementation of torch.ops.tokenswift.tree_attention (float32), the semantics of
// kernels/ops.py: T tree tokens attend to every committed cache slot and, among themselves,
// through a packed tree mask (bit j % 32 of word j / 32 in row i: node i sees node j).
//
// Why it exists: a verify pass of a few tokens over a long cache is what speculative decoding
// asks of attention. On a CPU torch's SDPA pays for each extra query row almost as much as for
// the first, so a 3-token verify at 8K context cost 1.3x a 1-token step in our measurements.
// Here the query rows of one KV group (group x T of them) sit in the lanes of a vector (16, or 8
// when they fit), so each key costs the same vector arithmetic (head_dim multiply-adds for the
// scores, head_dim for P·V, one vector exp) whether one row or all lanes use it: up to 16 rows
// (T = 4 with 4 query heads per KV head) a verify's attention costs what one token's does, and
// reading K/V once is the rest. AVX2 builds (16 registers of 8 floats) take register tiles of up to
// 6 rows over transposed keys (run_rows, below); AVX-512 builds with head_dim a multiple of 32, 16-key
// register tiles (attend_range_blocked512). Each path computes a row the same way whatever else is in
// the call, so a verify's rows have the bits of the AR steps at their positions (run_lanes).
//
// Work items are (KV head, key range) pairs run in parallel (flash-decoding split over the keys),
// balanced over the threads, each prefetching its next block of keys and values a line at a time;
// each keeps an online softmax per row; a combine step merges the ranges. Compiled on first use by
// runtime/kernels.load_cpu_kernels() with -O3 -march=native -ffast-math, which vectorises expf
// through glibc's vector math library (the AVX2 paths have their own, exp8). No infinities are used
// (fast-math assumes none): masked scores are a finite sentinel, and a row with no visible key in a
// range skips it.
#include "kernels_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if !defined(__GNUC__)
#error "the CPU tree-attention kernel needs GCC or Clang vector extensions"
#endif

namespace {

// A vector of L floats (GCC/Clang vector extension): 16 = one AVX-512 register, 8 = one AVX2
// register. Row r of a tile lives in lane r. Trees whose KV group has at most 8 query rows (T <= 2
// with 3-4 query heads per KV head) take 8 lanes: the arithmetic per key halves, and on CPUs
// whose AVX-512 units are 256 bits wide (AMD Zen 4) an 8-lane operation costs half a 16-lane one.
template <int L>
struct Lanes;
template <>
struct Lanes<16> {
    typedef float type __attribute__((vector_size(64)));
};
template <>
struct Lanes<8> {
    typedef float type __attribute__((vector_size(32)));
};

constexpr int kBlock = 32;           // keys per online-softmax update
constexpr int kChunk = 8;            // head dims held in registers at a time
constexpr float kMasked = -1.0e30f;  // score of a key the row may not see
constexpr int64_t kSpan = 512;  // keys per work item (a multiple of kBlock)

struct Item {
    int64_t kv_head;
    int64_t begin;  // key range [begin, end)
    int64_t end;
};

// Work items: each KV head's keys in ranges of kSpan from the first, run in parallel (flash-decoding
// split) and merged in order. The cuts sit at fixed positions, whatever the cache's length, the tree's
// size or the thread count: a tree node's row meets its keys in the same ranges, blocks and merge as
// the AR step at its position (a range past a row's last visible key adds exact zeros), which with the
// per-row arithmetic below gives it the same bits, so TokenSwift's tokens are AR's.
std::vector<Item> key_ranges(int64_t kv_heads, int64_t length) {
    std::vector<Item> items;
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t begin = 0; begin < length; begin += kSpan)
            items.push_back({h, begin, std::min(length, begin + kSpan)});
    return items;
}

// Online-softmax state of one work item, per tile of L rows: running max, sum, unnormalised output.
template <typename V>
struct Partial {
    std::vector<V> max;     // [tiles]
    std::vector<V> sum;     // [tiles]
    std::vector<V> output;  // [tiles, D]: output[t * D + d] lane r = row t*L + r, dim d
};

template <typename V>
inline V splat(float x) {
    return V{} + x;
}

template <typename V>
inline V vmax(V a, V b) {
    return a > b ? a : b;
}

template <typename V>
inline V vexp(V x) {
    constexpr int L = sizeof(V) / sizeof(float);
    alignas(64) float lanes[L];
    alignas(64) float in[L];
    __builtin_memcpy(in, &x, sizeof(in));
#pragma omp simd
    for (int i = 0; i < L; ++i) lanes[i] = std::exp(in[i]);  // glibc's vector expf under -ffast-math
    V out;
    __builtin_memcpy(&out, lanes, sizeof(out));
    return out;
}

// One line of the next block's keys (in the score loop) or values (in the P·V loop) into L2, at every
// even step of those loops ((head-dim chunk, key) pairs: D / kChunk x kBlock = 4D steps each, twice the
// lines of a block's keys or values, kBlock x D floats / 16). The callers test the step's parity in
// the loop: tested inside this helper, GCC's code for the loops took ~1.5x as long on the Xeon.
// Without prefetches, once K/V are out of the caches the loop waits on memory: the score loop walks
// 32 rows 256 bytes apart, which the hardware prefetcher does not follow (SmolLM2's 30 layers at 4K
// context took 19 ms for 1 token on the AVX-512 Zen 4, 8 ms with them). Prefetching a whole block in
// one burst measured no faster than nothing (the misses queue up behind each other), and all 2 x D
// lines in the score loop alone stall that loop on the AVX-512 Xeon, whose cores keep ~16
// misses in flight, while the memory idled through the softmax and P·V; spread over both loops, 30
// layers at 4,096 keys took 12.7 ms instead of 14.5 (1 and 4 tokens alike). Addresses past the
// cache's end are harmless (a prefetch never faults).
template <int D>
inline void prefetch_next_block(const float* block, int line) {
    __builtin_prefetch(block + kBlock * D + line * 16, 0, 2);
}

template <int D, typename vec>
void attend_range(const vec* query,  // [tiles, D] transposed, scaled: query[t*D + d] lane r = row t*L+r, dim d
                  int64_t tiles, const vec* tree_bias,  // [T, tiles]: 0 or kMasked per lane, key = tree node
                  const float* keys, const float* values,  // [length, D] of one KV head
                  int64_t begin, int64_t end, int64_t prefix, Partial<vec>& out) {
    out.max.assign(tiles, splat<vec>(kMasked));
    out.sum.assign(tiles, splat<vec>(0.0f));
    out.output.assign(tiles * D, splat<vec>(0.0f));
    vec scores[kBlock];
    for (int64_t start = begin; start < end; start += kBlock) {
        const int count = static_cast<int>(std::min<int64_t>(kBlock, end - start));
        const float* key_block = keys + start * D;
        const float* value_block = values + start * D;
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const vec* q = query + tile * D;
            for (int j = 0; j < count; ++j) scores[j] = splat<vec>(0.0f);
            for (int dc = 0; dc < D; dc += kChunk) {  // scores[j] lane r = q_r . k_j
                vec qc[kChunk];
                for (int k = 0; k < kChunk; ++k) qc[k] = q[dc + k];
                for (int j = 0; j < count; ++j) {
                    if (tile == 0 && (j & 1) == 0) prefetch_next_block<D>(key_block, ((dc / kChunk) * kBlock + j) / 2);
                    const float* key = key_block + j * D + dc;
                    vec a = scores[j];
                    for (int k = 0; k < kChunk; ++k) a += qc[k] * key[k];
                    scores[j] = a;
                }
            }
            if (start + count > prefix) {  // the block reaches the tree's own keys
                for (int j = 0; j < count; ++j) {
                    const int64_t node = start + j - prefix;
                    if (node >= 0) scores[j] += tree_bias[node * tiles + tile];
                }
            }
            vec block_max = scores[0];
            for (int j = 1; j < count; ++j) block_max = vmax(block_max, scores[j]);
            const vec old_max = out.max[tile];
            const vec new_max = vmax(old_max, block_max);
            const vec correction = vexp(old_max - new_max);
            const vec visible_floor = splat<vec>(0.5f * kMasked);
            vec sum = out.sum[tile] * correction;
            for (int j = 0; j < count; ++j) {
                const vec p = vexp(scores[j] - new_max);
                scores[j] = scores[j] > visible_floor ? p : splat<vec>(0.0f);  // a masked key weighs 0
                sum += scores[j];
            }
            out.max[tile] = new_max;
            out.sum[tile] = sum;
            vec* acc = out.output.data() + tile * D;
            for (int dc = 0; dc < D; dc += kChunk) {  // acc[d] lane r += p_rj * v_j[d]
                vec a[kChunk];
                for (int k = 0; k < kChunk; ++k) a[k] = acc[dc + k] * correction;
                for (int j = 0; j < count; ++j) {
                    if (tile == 0 && (j & 1) == 0) prefetch_next_block<D>(value_block, ((dc / kChunk) * kBlock + j) / 2);
                    const float* value = value_block + j * D + dc;
                    for (int k = 0; k < kChunk; ++k) a[k] += scores[j] * value[k];
                }
                for (int k = 0; k < kChunk; ++k) acc[dc + k] = a[k];
            }
        }
    }
}

template <int D, int L>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tree_mask,
         double scale, at::Tensor& output) {
    using vec = typename Lanes<L>::type;
    constexpr int kLanes = L;
    const int64_t heads = query.size(0), tree_tokens = query.size(1);
    const int64_t kv_heads = keys.size(0), length = keys.size(1);
    const int64_t group = heads / kv_heads, rows = group * tree_tokens;
    const int64_t tiles = (rows + kLanes - 1) / kLanes;
    const int64_t prefix = length - tree_tokens, words = tree_mask.size(1);
    const int64_t head_stride = keys.stride(0);
    const float* q = query.data_ptr<float>();  // rows g*T + t of KV head h start at query head h*group
    const auto* mask = reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>());

    // queries transposed into lanes (padding lanes: zero queries, never written back)
    std::vector<vec> transposed(kv_heads * tiles * D, splat<vec>(0.0f));
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t row = 0; row < rows; ++row)
            for (int d = 0; d < D; ++d)
                transposed[(h * tiles + row / kLanes) * D + d][row % kLanes] =
                    static_cast<float>(q[(h * rows + row) * D + d] * scale);
    // per tree node and tile, 0 where the lane's row may see the node, kMasked where not
    std::vector<vec> tree_bias(tree_tokens * tiles, splat<vec>(0.0f));
    for (int64_t node = 0; node < tree_tokens; ++node)
        for (int64_t row = 0; row < rows; ++row) {
            const uint32_t* bits = mask + (row % tree_tokens) * words;
            if (!((bits[node >> 5] >> (node & 31)) & 1u)) tree_bias[node * tiles + row / kLanes][row % kLanes] = kMasked;
        }

    const std::vector<Item> items = key_ranges(kv_heads, length);
    std::vector<Partial<vec>> partials(items.size());
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
            const Item& item = items[i];
            attend_range<D, vec>(transposed.data() + item.kv_head * tiles * D, tiles, tree_bias.data(),
                            keys.data_ptr<float>() + item.kv_head * head_stride,
                            values.data_ptr<float>() + item.kv_head * head_stride, item.begin, item.end, prefix,
                            partials[i]);
        }
    });

    // merge the key ranges of each KV head; a row that sees nothing gives 0
    float* result = output.data_ptr<float>();
    const int64_t per_head = static_cast<int64_t>(items.size()) / kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t tile = 0; tile < tiles; ++tile) {
            vec best = splat<vec>(kMasked);
            for (int64_t s = 0; s < per_head; ++s) best = vmax(best, partials[h * per_head + s].max[tile]);
            vec total = splat<vec>(0.0f);
            vec merged[D];
            for (int d = 0; d < D; ++d) merged[d] = splat<vec>(0.0f);
            for (int64_t s = 0; s < per_head; ++s) {
                const Partial<vec>& part = partials[h * per_head + s];
                const vec weight = vexp(part.max[tile] - best);
                total += part.sum[tile] * weight;
                for (int d = 0; d < D; ++d) merged[d] += part.output[tile * D + d] * weight;
            }
            for (int lane = 0; lane < kLanes; ++lane) {
                const int64_t row = tile * kLanes + lane;
                if (row >= rows) break;
                const float inverse = total[lane] > 0.0f ? 1.0f / total[lane] : 0.0f;
                float* target = result + (h * rows + row) * D;
                for (int d = 0; d < D; ++d) target[d] = merged[d][lane] * inverse;
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2 (16 registers of 8 floats) does not take rows in lanes (above): a one-token step of a model
// with 3 query heads per KV head would fill 3 of 8 lanes. Register tiles of up to 6 rows
// (attend_range_blocked) use all 8 lanes: each block's keys are transposed once (head dims first,
// keys in the lanes) for all rows; a tile's scores are R rows x 16 keys in 2R accumulators, each dim's
// key vectors loaded once for the R rows and each row's query value broadcast once for 16 keys; its
// P·V R rows x 16 head dims, each value vector loaded once for the R rows. SmolLM2's 30 layers at
// 4,096 keys, T = 4: 16.8 ms with 8-lane row tiles, 12.3 ms with these (docs/runtime.md).
#include <immintrin.h>

#define TOKENSWIFT_ATTENTION_ROWS 1

// e^x for 8 floats, inline: x = n ln2 + r with |r| <= ln2 / 2 (n rounded, ln2 in two parts), e^r
// from a degree-6 polynomial, 2^n put in the exponent; within ~2 ulp of expf. Arguments are clamped
// to [-87.3, 88.3], so a masked score (-1e30 less the max) gives ~1e-38, which the caller zeroes.
// It replaces glibc's vector expf (a call, and the vector's round trip through memory) in the AVX2
// paths: ~14 instructions in registers.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// Online-softmax state of one work item per query row.
struct RowPartial {
    std::vector<float> max;     // [rows]
    std::vector<float> sum;     // [rows]
    std::vector<float> output;  // [rows, D], unnormalised
};

inline float horizontal_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_sum(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// One row's block of kBlock scores (keys start .. start + count - 1) -> its softmax weights in place:
// keys past `count`, and the tree's keys (from `prefix` on) that the row's mask bits hide, weigh 0;
// the row's running max and sum are updated. Returns the factor that rescales the row's output so far.
inline float softmax_block(float* scores, int count, int64_t start, int64_t prefix, const uint32_t* bits,
                           float& max, float& sum) {
    constexpr int kGroups = kBlock / 8;
    for (int j = count; j < kBlock; ++j) scores[j] = kMasked;
    for (int64_t j = std::max<int64_t>(0, prefix - start); j < count; ++j) {  // the tree's own keys
        const int64_t node = start + j - prefix;
        if (!((bits[node >> 5] >> (node & 31)) & 1u)) scores[j] = kMasked;
    }
    __m256 block_max = _mm256_load_ps(scores);
    for (int g = 1; g < kGroups; ++g) block_max = _mm256_max_ps(block_max, _mm256_load_ps(scores + 8 * g));
    const float new_max = std::max(max, horizontal_max(block_max));
    const float correction = _mm256_cvtss_f32(exp8(_mm256_set1_ps(max - new_max)));
    const __m256 shift = _mm256_set1_ps(new_max), visible_floor = _mm256_set1_ps(0.5f * kMasked);
    __m256 total = _mm256_setzero_ps();
    for (int g = 0; g < kGroups; ++g) {  // a masked key weighs 0
        const __m256 score = _mm256_load_ps(scores + 8 * g);
        const __m256 kept =
            _mm256_and_ps(exp8(_mm256_sub_ps(score, shift)), _mm256_cmp_ps(score, visible_floor, _CMP_GT_OQ));
        _mm256_store_ps(scores + 8 * g, kept);
        total = _mm256_add_ps(total, kept);
    }
    max = new_max;
    sum = sum * correction + horizontal_sum(total);
    return correction;
}

// 8 x 8 transpose: r[i] = 8 dims of key i in, 8 keys of dim i out.
inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// A block's keys, head dims first: transposed[d * kBlock + j] = key_j[d] (past `count`: its last key).
template <int D>
inline void transpose_block(const float* key_block, int count, float* transposed) {
    for (int g = 0; g < kBlock / 8; ++g)
        for (int c = 0; c < D / 8; ++c) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i)
                r[i] = _mm256_loadu_ps(key_block + std::min(8 * g + i, count - 1) * D + 8 * c);
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_store_ps(transposed + (8 * c + i) * kBlock + 8 * g, r[i]);
        }
}

// scores[r][half * 16 + i] = q_r . key_(half * 16 + i) for R <= 6 rows and one half (16 keys) of a block,
// from the block's transposed keys [D, kBlock]: 2R accumulators of 8 keys, a multiply-add chain over
// the head dims each. Prefetches one line of `ahead` per dim when given.
template <int D, int R>
inline void score_tile(const float* query, const float* transposed, int half, float* scores, const char* ahead) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        if (ahead != nullptr) __builtin_prefetch(ahead + d * 64, 0, 2);
        __m256 k0 = _mm256_load_ps(transposed + d * kBlock + half * 16);
        __m256 k1 = _mm256_load_ps(transposed + d * kBlock + half * 16 + 8);
        // in registers for the R rows: without this GCC folded the loads into each multiply-add
        // (a load per multiply-add again; T = 4 over 2,048 keys 9.2 ms against 8.2)
        __asm__("" : "+x"(k0), "+x"(k1));
        for (int r = 0; r < R; ++r) {
            const __m256 q = _mm256_broadcast_ss(query + r * D + d);
            acc[r][0] = _mm256_fmadd_ps(q, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(q, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_store_ps(scores + r * kBlock + half * 16, acc[r][0]);
        _mm256_store_ps(scores + r * kBlock + half * 16 + 8, acc[r][1]);
    }
}

// output[r][chunk * 16 ...] = output * correction_r + sum_j p[r][j] v_j for R rows, 16 head dims
template <int D, int R>
inline void value_tile(const float* weights, const float* correction, const float* value_block, int count, int chunk,
                       float* output) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_broadcast_ss(correction + r);
        acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(output + r * D + chunk * 16), scale);
        acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(output + r * D + chunk * 16 + 8), scale);
    }
    for (int j = 0; j < count; ++j) {
        __m256 v0 = _mm256_loadu_ps(value_block + j * D + chunk * 16);
        __m256 v1 = _mm256_loadu_ps(value_block + j * D + chunk * 16 + 8);
        __asm__("" : "+x"(v0), "+x"(v1));  // in registers for the R rows, as in score_tile
        for (int r = 0; r < R; ++r) {
            const __m256 p = _mm256_broadcast_ss(weights + r * kBlock + j);
            acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(output + r * D + chunk * 16, acc[r][0]);
        _mm256_storeu_ps(output + r * D + chunk * 16 + 8, acc[r][1]);
    }
}

// rows per register tile: 12 accumulators, 2 shared vectors and a broadcast of the 16 registers (tiles of
// 6 against 4: SmolLM2's 30 layers at 4,096 keys, T = 3 12.2 -> 10.7 ms, T = 4 13.6 -> 12.5)
constexpr int64_t kTileMax = 6;

template <int D>
void attend_range_blocked(const float* query,  // [rows, D] of one KV head, scaled
                          int64_t rows, int64_t tree_tokens, const uint32_t* mask, int64_t words,
                          const float* keys, const float* values,  // [length, D] of one KV head
                          int64_t begin, int64_t end, int64_t prefix, RowPartial& out) {
    static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
    constexpr int kLines = kBlock * D / 16;  // cache lines of a block's keys (or values)
    out.max.assign(rows, kMasked);
    out.sum.assign(rows, 0.0f);
    out.output.assign(rows * D, 0.0f);
    // at least 2 tiles: the score passes prefetch a line of the next block per head dim, and a block's
    // keys and values take 4 x D lines (5-6 rows as one tile of 6 also measured no faster than 3 + 3)
    const int64_t tiles = std::max<int64_t>(2, (rows + kTileMax - 1) / kTileMax);
    alignas(32) float transposed[D * kBlock];
    std::vector<float> scores_storage(rows * kBlock + 8);
    float* scores =  // [rows, kBlock], 32-byte aligned
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scores_storage.data()) + 31) & ~uintptr_t(31));
    std::vector<float> corrections(rows);
    for (int64_t start = begin; start < end; start += kBlock) {
        const int count = static_cast<int>(std::min<int64_t>(kBlock, end - start));
        const float* key_block = keys + start * D;
        const float* value_block = values + start * D;
        transpose_block<D>(key_block, count, transposed);
        // scores, with the next block's keys and values prefetched a line per head dim over the tiles
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
            const int64_t count_rows = (rows - r0) / (tiles - t);
            for (int half = 0; half < 2; ++half) {
                const int64_t line = (t * 2 + half) * D;  // first of this pass's lines
                const char* ahead = nullptr;
                if (line < 2 * kLines)
                    ahead = reinterpret_cast<const char*>((line < kLines ? key_block : value_block) + kBlock * D) +
                            (line % kLines) * 64;
                const float* q = query + r0 * D;
                float* s = scores + r0 * kBlock;
                switch (count_rows) {
                    case 1: score_tile<D, 1>(q, transposed, half, s, ahead); break;
                    case 2: score_tile<D, 2>(q, transposed, half, s, ahead); break;
                    case 3: score_tile<D, 3>(q, transposed, half, s, ahead); break;
                    case 4: score_tile<D, 4>(q, transposed, half, s, ahead); break;
                    case 5: score_tile<D, 5>(q, transposed, half, s, ahead); break;
                    default: score_tile<D, 6>(q, transposed, half, s, ahead); break;
                }
            }
            r0 += count_rows;
        }
        for (int64_t r = 0; r < rows; ++r)  // masks and the online-softmax update, a row at a time
            corrections[r] = softmax_block(scores + r * kBlock, count, start, prefix, mask + (r % tree_tokens) * words,
                                           out.max[r], out.sum[r]);
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {  // P·V
            const int64_t count_rows = (rows - r0) / (tiles - t);
            for (int chunk = 0; chunk < D / 16; ++chunk) {
                const float* p = scores + r0 * kBlock;
                const float* c = corrections.data() + r0;
                float* o = out.output.data() + r0 * D;
                switch (count_rows) {
                    case 1: value_tile<D, 1>(p, c, value_block, count, chunk, o); break;
                    case 2: value_tile<D, 2>(p, c, value_block, count, chunk, o); break;
                    case 3: value_tile<D, 3>(p, c, value_block, count, chunk, o); break;
                    case 4: value_tile<D, 4>(p, c, value_block, count, chunk, o); break;
                    case 5: value_tile<D, 5>(p, c, value_block, count, chunk, o); break;
                    default: value_tile<D, 6>(p, c, value_block, count, chunk, o); break;
                }
            }
            r0 += count_rows;
        }
    }
}

#if defined(__AVX512F__)
// AVX-512 register tiles for a verify pass (5 rows per KV head and more). A block's 32 keys,
// transposed, are two 16-float vectors per head dim, so a tile of R <= 12 rows keeps all its scores in
// 2R of the 32 registers and P·V 32 head dims of its R rows; every multiply-add uses all 16 lanes (the
// 16-lane row tiles above use 12 for SmolLM2's 4-token verify: 3 query heads per KV head) and each
// loaded key or value vector feeds R rows. The next block's keys are prefetched over the score pass
// (2 lines per head dim) and its values over the P·V pass (2 per key and chunk), by the first tile.
constexpr int64_t kTileMax512 = 12;  // 24 accumulators, 2 shared vectors and a broadcast of 32 registers

// scores[r][0 .. 31] = q_r . key_j for the R rows of a tile, from the block's transposed keys [D, kBlock]
template <int D, int R>
inline void score_tile512(const float* query, const float* transposed, float* scores, const char* ahead) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
        if (ahead != nullptr) {
            __builtin_prefetch(ahead + 2 * d * 64, 0, 2);
            __builtin_prefetch(ahead + (2 * d + 1) * 64, 0, 2);
        }
        __m512 k0 = _mm512_load_ps(transposed + d * kBlock);
        __m512 k1 = _mm512_load_ps(transposed + d * kBlock + 16);
        __asm__("" : "+v"(k0), "+v"(k1));  // in registers for the R rows (as in score_tile)
        for (int r = 0; r < R; ++r) {
            const __m512 q = _mm512_set1_ps(query[r * D + d]);
            acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_store_ps(scores + r * kBlock, acc[r][0]);
        _mm512_store_ps(scores + r * kBlock + 16, acc[r][1]);
    }
}

// output[r][chunk * 32 ...] = output * correction_r + sum_j p[r][j] v_j for R rows, 32 head dims
template <int D, int R>
inline void value_tile512(const float* weights, const float* correction, const float* value_block, int count,
                          int chunk, float* output, const char* ahead) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_set1_ps(correction[r]);
        acc[r][0] = _mm512_mul_ps(_mm512_loadu_ps(output + r * D + chunk * 32), scale);
        acc[r][1] = _mm512_mul_ps(_mm512_loadu_ps(output + r * D + chunk * 32 + 16), scale);
    }
    for (int j = 0; j < count; ++j) {
        if (ahead != nullptr) {
            __builtin_prefetch(ahead + 2 * j * 64, 0, 2);
            __builtin_prefetch(ahead + (2 * j + 1) * 64, 0, 2);
        }
        __m512 v0 = _mm512_loadu_ps(value_block + j * D + chunk * 32);
        __m512 v1 = _mm512_loadu_ps(value_block + j * D + chunk * 32 + 16);
        __asm__("" : "+v"(v0), "+v"(v1));
        for (int r = 0; r < R; ++r) {
            const __m512 p = _mm512_set1_ps(weights[r * kBlock + j]);
            acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(output + r * D + chunk * 32, acc[r][0]);
        _mm512_storeu_ps(output + r * D + chunk * 32 + 16, acc[r][1]);
    }
}

#define TOKENSWIFT_TILE_CASES(CALL) \
    CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6) CALL(7) CALL(8) CALL(9) CALL(10) CALL(11) CALL(12)

template <int D>
void attend_range_blocked512(const float* query,  // [rows, D] of one KV head, scaled
                             int64_t rows, int64_t tree_tokens, const uint32_t* mask, int64_t words,
                             const float* keys, const float* values,  // [length, D] of one KV head
                             int64_t begin, int64_t end, int64_t prefix, RowPartial& out) {
    static_assert(D % 32 == 0, "head_dim must be a multiple of 32");
    static_assert(kBlock == 32, "a block's keys are two 16-float vectors");
    out.max.assign(rows, kMasked);
    out.sum.assign(rows, 0.0f);
    out.output.assign(rows * D, 0.0f);
    const int64_t tiles = (rows + kTileMax512 - 1) / kTileMax512;
    alignas(64) float transposed[D * kBlock];
    std::vector<float> scores_storage(rows * kBlock + 16);
    float* scores =  // [rows, kBlock], 64-byte aligned
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scores_storage.data()) + 63) & ~uintptr_t(63));
    std::vector<float> corrections(rows);
    for (int64_t start = begin; start < end; start += kBlock) {
        const int count = static_cast<int>(std::min<int64_t>(kBlock, end - start));
        const float* key_block = keys + start * D;
        const float* value_block = values + start * D;
        transpose_block<D>(key_block, count, transposed);
        const char* next_keys = reinterpret_cast<const char*>(key_block + kBlock * D);
        const char* next_values = reinterpret_cast<const char*>(value_block + kBlock * D);
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {  // scores
            const int64_t count_rows = (rows - r0) / (tiles - t);
            const float* q = query + r0 * D;
            float* s = scores + r0 * kBlock;
            const char* ahead = t == 0 ? next_keys : nullptr;
            switch (count_rows) {
#define TOKENSWIFT_SCORE_CASE(R) \
    case R: score_tile512<D, R>(q, transposed, s, ahead); break;
                TOKENSWIFT_TILE_CASES(TOKENSWIFT_SCORE_CASE)
#undef TOKENSWIFT_SCORE_CASE
                default: break;
            }
            r0 += count_rows;
        }
        for (int64_t r = 0; r < rows; ++r)  // masks and the online-softmax update, a row at a time
            corrections[r] = softmax_block(scores + r * kBlock, count, start, prefix, mask + (r % tree_tokens) * words,
                                           out.max[r], out.sum[r]);
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {  // P·V
            const int64_t count_rows = (rows - r0) / (tiles - t);
            for (int chunk = 0; chunk < D / 32; ++chunk) {
                const float* p = scores + r0 * kBlock;
                const float* c = corrections.data() + r0;
                float* o = out.output.data() + r0 * D;
                const char* ahead = t == 0 ? next_values + chunk * kBlock * 2 * 64 : nullptr;
                switch (count_rows) {
#define TOKENSWIFT_VALUE_CASE(R) \
    case R: value_tile512<D, R>(p, c, value_block, count, chunk, o, ahead); break;
                    TOKENSWIFT_TILE_CASES(TOKENSWIFT_VALUE_CASE)
#undef TOKENSWIFT_VALUE_CASE
                    default: break;
                }
            }
            r0 += count_rows;
        }
    }
}
#undef TOKENSWIFT_TILE_CASES
#endif

template <int D>
void run_rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tree_mask,
              double scale, at::Tensor& output) {
    const int64_t heads = query.size(0), tree_tokens = query.size(1);
    const int64_t kv_heads = keys.size(0), length = keys.size(1);
    const int64_t rows = heads / kv_heads * tree_tokens;  // per KV head: row g*T + t = query head h*group + g
    const int64_t prefix = length - tree_tokens, words = tree_mask.size(1);
    const int64_t head_stride = keys.stride(0);
    const float* q = query.data_ptr<float>();
    const auto* mask = reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>());
    std::vector<float> scaled(kv_heads * rows * D);
    for (int64_t i = 0; i < kv_heads * rows * D; ++i) scaled[i] = static_cast<float>(q[i] * scale);

    const std::vector<Item> items = key_ranges(kv_heads, length);
    std::vector<RowPartial> partials(items.size());
    const auto attend = [] {
#if defined(__AVX512F__)
        return attend_range_blocked512<D>;
#else
        return attend_range_blocked<D>;
#endif
    }();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
            const Item& item = items[i];
            attend(
                scaled.data() + item.kv_head * rows * D, rows, tree_tokens, mask, words,
                keys.data_ptr<float>() + item.kv_head * head_stride,
                values.data_ptr<float>() + item.kv_head * head_stride, item.begin, item.end, prefix, partials[i]);
        }
    });

    // merge the key ranges of each KV head; a row that sees nothing gives 0. Only the ranges up to the
    // row's own key, as many as the AR step at that key has (-ffast-math may reorder a merge's sums by
    // its length)
    float* result = output.data_ptr<float>();
    const int64_t per_head = static_cast<int64_t>(items.size()) / kv_heads;
    for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t row = 0; row < rows; ++row) {
            const int64_t seen = std::min<int64_t>(per_head, (prefix + row % tree_tokens) / kSpan + 1);
            float best = kMasked;
            for (int64_t s = 0; s < seen; ++s) best = std::max(best, partials[h * per_head + s].max[row]);
            float total = 0.0f;
            float merged[D] = {};
            for (int64_t s = 0; s < seen; ++s) {
                const RowPartial& part = partials[h * per_head + s];
                const float weight = std::exp(part.max[row] - best);
                total += part.sum[row] * weight;
                for (int d = 0; d < D; ++d) merged[d] += part.output[row * D + d] * weight;
            }
            const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
            float* target = result + (h * rows + row) * D;
            for (int d = 0; d < D; ++d) target[d] = merged[d] * inverse;
        }
}
#endif

// Every row of a call takes the same path, whatever the row count, so that a verify's row is computed
// with the arithmetic of the AR step at its position (per row: its scores, softmax and P·V, in the
// same order): AVX-512 with head_dim a multiple of 32, 16-key register tiles (attend_range_blocked512);
// other AVX-512 head dims, 16-lane row tiles; AVX2, register tiles of up to 6 rows
// (attend_range_blocked); other vector units, 8-lane row tiles. A row-at-a-time path for AR steps
// alone was faster there (on AVX2, 10.2 against 13.9 ms for SmolLM2's 30 layers at 4,096 keys) but
// summed in another order than the tiles, so at a near-tie TokenSwift's token could differ from AR's.
template <int D>
void run_lanes(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tree_mask,
               double scale, at::Tensor& output) {
#if defined(__AVX512F__)
    if constexpr (D % 32 == 0)
        run_rows<D>(query, keys, values, tree_mask, scale, output);
    else
        run<D, 16>(query, keys, values, tree_mask, scale, output);
#elif defined(TOKENSWIFT_ATTENTION_ROWS)
    run_rows<D>(query, keys, values, tree_mask, scale, output);
#else
    run<D, 8>(query, keys, values, tree_mask, scale, output);
#endif
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                              const at::Tensor& tree_mask, double scale) {
    TORCH_CHECK(query.device().is_cpu() && query.scalar_type() == at::kFloat && query.dim() == 3 && query.is_contiguous(),
                "query must be a contiguous float32 CPU tensor [heads, T, head_dim]");
    for (const at::Tensor* cache : {&keys, &values}) {
        TORCH_CHECK(cache->device().is_cpu() && cache->scalar_type() == at::kFloat && cache->dim() == 3 &&
                        cache->stride(2) == 1 && cache->stride(1) == cache->size(2),
                    "keys and values must be float32 CPU tensors [kv_heads, length, head_dim], rows contiguous");
    }
    TORCH_CHECK(keys.sizes() == values.sizes() && keys.strides() == values.strides(), "keys and values must match");
    TORCH_CHECK(keys.size(2) == query.size(2), "keys must have the query's head_dim");
    TORCH_CHECK(query.size(0) % keys.size(0) == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(keys.size(1) >= query.size(1), "keys must include the tree's own T positions");
    TORCH_CHECK(tree_mask.scalar_type() == at::kInt && tree_mask.is_contiguous() && tree_mask.dim() == 2 &&
                    tree_mask.size(0) == query.size(1) && tree_mask.size(1) == (query.size(1) + 31) / 32,
                "tree_mask must be a contiguous int32 tensor [T, ceil(T / 32)]");
    at::Tensor output = at::empty_like(query);
    switch (query.size(2)) {
        case 16: run_lanes<16>(query, keys, values, tree_mask, scale, output); break;
        case 32: run_lanes<32>(query, keys, values, tree_mask, scale, output); break;
        case 64: run_lanes<64>(query, keys, values, tree_mask, scale, output); break;
        case 128: run_lanes<128>(query, keys, values, tree_mask, scale, output); break;
        default: TORCH_CHECK(false, "the CPU tree-attention kernel covers head_dim 16, 32, 64 and 128, got ", query.size(2));
    }
    return output;
}
