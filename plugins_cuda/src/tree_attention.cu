// Tree-verify attention: T tree tokens attend to a long cache (all of it) and to each other
// (through a packed tree mask), flash-decoding style.
//
// Grid: x = block of 64 query rows of one KV group, y = split of the key dimension, z = KV head.
// The query rows of KV head h are the G = num_heads / num_kv_heads query heads that share it,
// each with its T tree tokens: with query laid out [num_heads, T, head_dim], they are the
// contiguous rows h*G*T .. (h+1)*G*T - 1, and row r belongs to tree node r % T.
// Each block walks its split's keys in tiles of 64: S = Q K^T on tensor cores (WMMA, fp32
// accumulation), online softmax per row in fp32 (log2 domain), O += P V on tensor cores.
// It writes its unnormalised output and (max, sum) per row; a second kernel combines the splits.
// Row blocks are the fastest grid dimension, so the blocks reading one split's K/V run together
// and share it through L2.
#include <algorithm>
#include <cmath>

#include <mma.h>

#include "common.cuh"

namespace tokenswift {
namespace {

using namespace nvcuda;
using detail::aligned16;
using detail::ceil_div;
using detail::from_float;
using detail::load_rows;
using detail::to_float;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kWarps * 16;   // query rows per block (16 per warp)
constexpr int kKeys = 64;            // keys per tile
constexpr int kMinKeysPerSplit = 256;
constexpr float kLog2e = 1.4426950408889634f;

// Shared-memory row strides (elements), padded against bank conflicts; every WMMA tile start stays
// 32-byte aligned. head_dim 128 takes 104,192 bytes: A100/H100 (163/227 KB per block) run it;
// GPUs with 99 KB per block run head_dim 64 only (runtime/kernels.py checks before use).
template <int D>
struct Layout {
    static constexpr int kQ = D + 8;        // Q, K, V tiles (16-bit)
    static constexpr int kS = kKeys + 4;    // scores (fp32)
    static constexpr int kP = kKeys + 8;    // probabilities (16-bit), written over the warp's scores
    static constexpr int kO = D + 4;        // output accumulator (fp32)
    static constexpr size_t q_bytes = size_t(kRows) * kQ * 2;
    static constexpr size_t kv_bytes = size_t(kKeys) * kQ * 2;
    static constexpr size_t s_bytes = size_t(kRows) * kS * 4;
    static constexpr size_t o_bytes = size_t(kRows) * kO * 4;
    static constexpr size_t stats_bytes = size_t(kRows) * 3 * 4;
    static constexpr size_t total = q_bytes + 2 * kv_bytes + s_bytes + o_bytes + stats_bytes;
    static_assert(16 * kP * 2 <= 16 * kS * 4, "a warp's probabilities fit in its score rows");
};

struct SplitArgs {
    const void* query;
    const void* keys;
    const void* values;
    const uint32_t* tree_mask;
    float* partial_out;    // [splits, num_heads * T, D]
    float* partial_max;    // [splits, num_heads * T]
    float* partial_sum;    // [splits, num_heads * T]
    int64_t kv_head_stride;
    int group_rows;        // G * T
    int num_tree;
    int mask_words;
    int key_length;        // capacity bound when prefix_length_device is set
    int keys_per_split;
    const int32_t* prefix_length_device;
    int total_rows;        // num_heads * T
    float scale_log2;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) tree_attention_split_kernel(SplitArgs args) {
    using L = Layout<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = reinterpret_cast<T*>(smem + L::q_bytes);
    T* v_s = reinterpret_cast<T*>(smem + L::q_bytes + L::kv_bytes);
    float* s_s = reinterpret_cast<float*>(smem + L::q_bytes + 2 * L::kv_bytes);
    float* o_s = reinterpret_cast<float*>(smem + L::q_bytes + 2 * L::kv_bytes + L::s_bytes);
    float* max_s = reinterpret_cast<float*>(smem + L::q_bytes + 2 * L::kv_bytes + L::s_bytes + L::o_bytes);
    float* sum_s = max_s + kRows;
    float* correction_s = sum_s + kRows;

    const int row0 = blockIdx.x * kRows;
    const int split = blockIdx.y;
    const int kv_head = blockIdx.z;
    const int rows_here = min(kRows, args.group_rows - row0);
    int key_length = args.key_length;
    int keys_per_split = args.keys_per_split;
    if (args.prefix_length_device != nullptr) {  // graph replay: the length lives on the device
        key_length = min(args.key_length, *args.prefix_length_device + args.num_tree);
        const int per_split = (key_length + gridDim.y - 1) / gridDim.y;
        keys_per_split = (per_split + kKeys - 1) / kKeys * kKeys;
    }
    const int prefix = key_length - args.num_tree;
    const int key_begin = split * keys_per_split;
    const int key_end = min(key_length, key_begin + keys_per_split);

    const T* query = static_cast<const T*>(args.query) + (int64_t(kv_head) * args.group_rows + row0) * D;
    const T* keys = static_cast<const T*>(args.keys) + kv_head * args.kv_head_stride;
    const T* values = static_cast<const T*>(args.values) + kv_head * args.kv_head_stride;

    load_rows(q_s, L::kQ, query, D, kRows, rows_here, D);
    for (int i = threadIdx.x; i < kRows * L::kO; i += kThreads) o_s[i] = 0.0f;
    for (int i = threadIdx.x; i < kRows; i += kThreads) {
        max_s[i] = -INFINITY;
        sum_s[i] = 0.0f;
    }
    __syncthreads();

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const bool warp_has_rows = warp * 16 < rows_here;
    const T* q_w = q_s + warp * 16 * L::kQ;
    float* s_w = s_s + warp * 16 * L::kS;
    T* p_w = reinterpret_cast<T*>(s_w);  // P overwrites S once every lane has read its scores
    float* o_w = o_s + warp * 16 * L::kO;

    // This lane's softmax row (two lanes per row, 32 columns each) and its tree node.
    const int softmax_row = lane / 2;
    const int half = lane % 2;
    const int block_row = warp * 16 + softmax_row;
    const int group_row = row0 + block_row;
    const int node = group_row < args.group_rows ? group_row % args.num_tree : 0;
    const uint32_t* mask_row = args.tree_mask + int64_t(node) * args.mask_words;

    for (int tile = key_begin; tile < key_end; tile += kKeys) {
        const int tile_keys = min(kKeys, key_end - tile);
        load_rows(k_s, L::kQ, keys + int64_t(tile) * D, D, kKeys, tile_keys, D);
        load_rows(v_s, L::kQ, values + int64_t(tile) * D, D, kKeys, tile_keys, D);
        __syncthreads();
        if (warp_has_rows) {
            // S[16, 64] = Q_w[16, D] K_tile^T
            for (int n = 0; n < kKeys / 16; ++n) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> score;
                wmma::fill_fragment(score, 0.0f);
                for (int k = 0; k < D / 16; ++k) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
                    wmma::load_matrix_sync(a, q_w + k * 16, L::kQ);
                    wmma::load_matrix_sync(b, k_s + n * 16 * L::kQ + k * 16, L::kQ);
                    wmma::mma_sync(score, a, b, score);
                }
                wmma::store_matrix_sync(s_w + n * 16, score, L::kS, wmma::mem_row_major);
            }
            __syncwarp();

            // Online softmax of this lane's 32 columns, combined with the other half of the row.
            float logits[32];
            float tile_max = -INFINITY;
            for (int c = 0; c < 32; ++c) {
                const int column = half * 32 + c;
                const int key = tile + column;
                bool visible = column < tile_keys;
                if (visible && key >= prefix) {
                    const int tree_key = key - prefix;
                    visible = (mask_row[tree_key / 32] >> (tree_key % 32)) & 1u;
                }
                logits[c] = visible ? s_w[softmax_row * L::kS + column] * args.scale_log2 : -INFINITY;
                tile_max = fmaxf(tile_max, logits[c]);
            }
            __syncwarp();  // all scores are in registers before P is written over them
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            const float old_max = max_s[block_row];
            const float new_max = fmaxf(old_max, tile_max);
            const bool nothing_visible = new_max == -INFINITY;
            const float correction = nothing_visible ? 1.0f : exp2f(old_max - new_max);
            float tile_sum = 0.0f;
            for (int c = 0; c < 32; ++c) {
                const float p = nothing_visible ? 0.0f : exp2f(logits[c] - new_max);
                tile_sum += p;
                p_w[softmax_row * L::kP + half * 32 + c] = from_float<T>(p);
            }
            tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
            if (half == 0) {
                max_s[block_row] = new_max;
                sum_s[block_row] = sum_s[block_row] * correction + tile_sum;
                correction_s[block_row] = correction;
            }
            __syncwarp();

            for (int i = lane; i < 16 * D; i += 32) {
                const int r = i / D;
                o_w[r * L::kO + i % D] *= correction_s[warp * 16 + r];
            }
            __syncwarp();

            // O_w[16, D] += P_w[16, 64] V_tile[64, D]
            for (int n = 0; n < D / 16; ++n) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> out;
                wmma::load_matrix_sync(out, o_w + n * 16, L::kO, wmma::mem_row_major);
                for (int k = 0; k < kKeys / 16; ++k) {
                    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
                    wmma::load_matrix_sync(a, p_w + k * 16, L::kP);
                    wmma::load_matrix_sync(b, v_s + k * 16 * L::kQ + n * 16, L::kQ);
                    wmma::mma_sync(out, a, b, out);
                }
                wmma::store_matrix_sync(o_w + n * 16, out, L::kO, wmma::mem_row_major);
            }
            __syncwarp();
        }
        __syncthreads();
    }

    const int64_t out_row0 = int64_t(split) * args.total_rows + int64_t(kv_head) * args.group_rows + row0;
    for (int i = threadIdx.x; i < rows_here * D; i += kThreads) {
        const int r = i / D;
        args.partial_out[(out_row0 + r) * D + i % D] = o_s[r * L::kO + i % D];
    }
    for (int r = threadIdx.x; r < rows_here; r += kThreads) {
        args.partial_max[out_row0 + r] = max_s[r];
        args.partial_sum[out_row0 + r] = sum_s[r];
    }
}

// One block per query row, one thread per output element: out = sum_s w_s O_s / sum_s w_s l_s,
// w_s = 2^(m_s - max_s m_s).
template <typename T, int D>
__global__ void __launch_bounds__(D) tree_attention_combine_kernel(const float* partial_out, const float* partial_max,
                                                                   const float* partial_sum, T* output, int splits,
                                                                   int total_rows) {
    const int row = blockIdx.x;
    const int d = threadIdx.x;
    float top = -INFINITY;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, partial_max[int64_t(s) * total_rows + row]);
    float numerator = 0.0f;
    float denominator = 0.0f;
    if (top != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const int64_t at = int64_t(s) * total_rows + row;
            const float weight = exp2f(partial_max[at] - top);  // 0 for a split that saw nothing
            numerator += weight * partial_out[at * D + d];
            denominator += weight * partial_sum[at];
        }
    }
    output[int64_t(row) * D + d] = from_float<T>(denominator > 0.0f ? numerator / denominator : 0.0f);
}

cudaError_t check(const TreeAttentionParams& p) {
    const bool shapes_ok = (p.head_dim == 64 || p.head_dim == 128) && p.num_tree >= 1 && p.num_tree <= 256 &&
                           p.num_kv_heads >= 1 && p.num_heads >= p.num_kv_heads &&
                           p.num_heads % p.num_kv_heads == 0 && p.key_length >= p.num_tree &&
                           p.kv_head_stride >= int64_t(p.key_length) * p.head_dim && p.kv_head_stride % 8 == 0;
    const bool pointers_ok = p.query && p.keys && p.values && p.tree_mask && p.output && aligned16(p.query) &&
                             aligned16(p.keys) && aligned16(p.values);
    return shapes_ok && pointers_ok ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, int D>
cudaError_t launch(const TreeAttentionParams& p, float* workspace, int splits, cudaStream_t stream) {
    const int group_rows = p.num_heads / p.num_kv_heads * p.num_tree;
    const int total_rows = p.num_heads * p.num_tree;
    SplitArgs args{};
    args.query = p.query;
    args.keys = p.keys;
    args.values = p.values;
    args.tree_mask = p.tree_mask;
    args.partial_out = workspace;
    args.partial_max = workspace + int64_t(splits) * total_rows * D;
    args.partial_sum = args.partial_max + int64_t(splits) * total_rows;
    args.kv_head_stride = p.kv_head_stride;
    args.group_rows = group_rows;
    args.num_tree = p.num_tree;
    args.mask_words = tree_mask_words(p.num_tree);
    args.key_length = p.key_length;
    args.keys_per_split = ceil_div(ceil_div(p.key_length, splits), kKeys) * kKeys;
    args.total_rows = total_rows;
    args.scale_log2 = p.scale * kLog2e;
    args.prefix_length_device = p.prefix_length_device;

    const size_t smem = Layout<D>::total;
    cudaError_t status = cudaFuncSetAttribute(tree_attention_split_kernel<T, D>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return status;
    const dim3 grid(ceil_div(group_rows, kRows), splits, p.num_kv_heads);
    tree_attention_split_kernel<T, D><<<grid, kThreads, smem, stream>>>(args);
    tree_attention_combine_kernel<T, D><<<total_rows, D, 0, stream>>>(
        args.partial_out, args.partial_max, args.partial_sum, static_cast<T*>(p.output), splits, total_rows);
    return cudaGetLastError();
}

}  // namespace

size_t tree_attention_shared_bytes(int32_t head_dim) {
    return head_dim == 64 ? Layout<64>::total : head_dim == 128 ? Layout<128>::total : 0;
}

int32_t tree_attention_splits(const TreeAttentionParams& params, int32_t num_sms) {
    const int group_rows = params.num_heads / std::max(1, params.num_kv_heads) * params.num_tree;
    const int blocks_per_split = std::max(1, ceil_div(group_rows, kRows) * params.num_kv_heads);
    const int wanted = ceil_div(2 * std::max(1, num_sms), blocks_per_split);
    const int most = std::max(1, ceil_div(params.key_length, kMinKeysPerSplit));
    return std::max(1, std::min(wanted, most));
}

size_t tree_attention_workspace_size(const TreeAttentionParams& params, int32_t splits) {
    const size_t rows = size_t(params.num_heads) * params.num_tree;
    return size_t(splits) * rows * (params.head_dim + 2) * sizeof(float);
}

cudaError_t tree_attention(const TreeAttentionParams& params, void* workspace, size_t workspace_bytes,
                           int32_t num_sms, cudaStream_t stream) {
    cudaError_t status = check(params);
    if (status != cudaSuccess) return status;
    const int splits = params.num_splits > 0 ? params.num_splits : tree_attention_splits(params, num_sms);
    if (workspace == nullptr || workspace_bytes < tree_attention_workspace_size(params, splits)) {
        return cudaErrorInvalidValue;
    }
    float* scratch = static_cast<float*>(workspace);
    const bool half = params.dtype == DataType::kFloat16;
    if (params.head_dim == 64) {
        return half ? launch<__half, 64>(params, scratch, splits, stream)
                    : launch<__nv_bfloat16, 64>(params, scratch, splits, stream);
    }
    return half ? launch<__half, 128>(params, scratch, splits, stream)
                : launch<__nv_bfloat16, 128>(params, scratch, splits, stream);
}

}  // namespace tokenswift
