// Tree-verify attention: T tree tokens attend to a long cache (all of it) and to each other
// (through a packed tree mask), flash-decoding style.
//
// Grid: x = block of 64 query rows of one KV group, y = split of the key dimension, z = KV head.
// The query rows of KV head h are the G = num_heads / num_kv_heads query heads that share it,
// each with its T tree tokens: with query laid out [num_heads, T, head_dim], they are the
// contiguous rows h*G*T .. (h+1)*G*T - 1, and row r belongs to tree node r % T.
// Each of the block's 4 warps owns 16 query rows and keeps everything of them in registers
// (FlashAttention-2 layout): its Q fragments, the scores S = Q K^T of a 64-key tile (mma.sync
// m16n8k16, fp32 accumulation), the online softmax in fp32 (log2 domain), and the output
// accumulator O += P V, where P goes from the score registers straight into the next matrix
// product. K/V tiles stream through shared memory with cp.async, two stages deep, so the next
// tile loads while this one is computed. The block writes its unnormalised output and
// (max, sum) per row; a second kernel combines the splits. Row blocks are the fastest grid
// dimension, so the blocks reading one split's K/V run together and share it through L2.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>

#include "common.cuh"

namespace tokenswift {
namespace {

using detail::aligned16;
using detail::ceil_div;
using detail::from_float;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 64;            // keys per tile
constexpr int kMinKeysPerSplit = 256;
constexpr float kLog2e = 1.4426950408889634f;
// A warp owns M row tiles of 16 query rows (M = 1 or 2): with 2, every K/V fragment read from
// shared memory feeds two matrix products (half the shared-memory traffic per operation) at the
// price of 128-row blocks, which pad small trees more.
constexpr int kRowsPerTile = 16;
__host__ __device__ constexpr int block_rows(int m) { return kWarps * kRowsPerTile * m; }
// Row tiles per warp from this many query rows per KV head upwards.
constexpr int kTwoTilesFromRows = 256;

// Shared memory: Q [64 or 128 rows] and two stages of K and V tiles [64 keys], rows padded by 16
// bytes so that the 8 row addresses of an ldmatrix fall in distinct banks. head_dim 128: 87,040
// bytes with one row tile per warp, 104,448 with two (two blocks fit an H100's SM, one an A100's;
// GPUs that allow 99 KB per block run one tile).
template <int D, int M>
struct Layout {
    static constexpr int kStride = D + 8;  // 16-bit elements per shared row
    static constexpr size_t q_bytes = size_t(block_rows(M)) * kStride * 2;
    static constexpr size_t tile_bytes = size_t(kKeys) * kStride * 2;
    static constexpr size_t total = q_bytes + 4 * tile_bytes;  // Q, K x 2 stages, V x 2 stages
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

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared without passing through registers; zero-filled when !valid.
__device__ __forceinline__ void copy_async(void* shared, const void* global, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

template <int Pending>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const void* shared) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(shared)));
}

__device__ __forceinline__ void load_matrices_transposed(uint32_t (&r)[4], const void* shared) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(shared)));
}

// c[16x8] += a[16x16] b[16x8]. Lane l (g = l / 4, t = l % 4) holds c rows g and g + 8, columns
// 2t and 2t + 1; a rows g, g + 8 x columns 2t.., 2t + 8..; b rows 2t.., 2t + 8.. x column g.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one register of two 16-bit elements, the lower column in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack(float low, float high);

template <>
__device__ __forceinline__ uint32_t pack<__nv_bfloat16>(float low, float high) {
    __nv_bfloat162 v = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack<__half>(float low, float high) {
    __half2 v = __floats2half2_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&v);
}

// `Rows` rows of D elements (global rows D apart) into a padded shared tile; rows >= valid are zeros.
template <typename T, int D, int Rows>
__device__ __forceinline__ void load_tile(T* shared, const T* global, int valid) {
    constexpr int kVectors = D / 8;
    for (int item = threadIdx.x; item < Rows * kVectors; item += kThreads) {
        const int row = item / kVectors;
        const int column = (item % kVectors) * 8;
        const bool ok = row < valid;
        copy_async(shared + row * (D + 8) + column, ok ? global + int64_t(row) * D + column : global, ok);
    }
}

template <typename T, int D, int M>
__global__ void __launch_bounds__(kThreads) tree_attention_split_kernel(SplitArgs args) {
    constexpr int kStride = Layout<D, M>::kStride;
    constexpr int kTile = kKeys * kStride;  // elements per shared K/V tile
    constexpr int kRows = block_rows(M);
    extern __shared__ __align__(128) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem);
    T* k_s = q_s + kRows * kStride;  // stages at k_s and k_s + kTile
    T* v_s = k_s + 2 * kTile;        // stages at v_s and v_s + kTile

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
    const int tiles = key_end > key_begin ? (key_end - key_begin + kKeys - 1) / kKeys : 0;

    const T* query = static_cast<const T*>(args.query) + (int64_t(kv_head) * args.group_rows + row0) * D;
    const T* keys = static_cast<const T*>(args.keys) + kv_head * args.kv_head_stride;
    const T* values = static_cast<const T*>(args.values) + kv_head * args.kv_head_stride;

    load_tile<T, D, kRows>(q_s, query, rows_here);
    commit_copies();
    if (tiles > 0) {
        load_tile<T, D, kKeys>(k_s, keys + int64_t(key_begin) * D, min(kKeys, key_end - key_begin));
        load_tile<T, D, kKeys>(v_s, values + int64_t(key_begin) * D, min(kKeys, key_end - key_begin));
    }
    commit_copies();
    wait_copies<1>();  // Q has landed (the first tile may still be in flight)
    __syncthreads();

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int warp_row = warp * kRowsPerTile * M;  // the warp's first row in the block
    const bool active = warp_row < rows_here;      // warp-uniform
    // ldmatrix addressing: lane l names row l % 8 of matrix l / 8
    const int matrix = lane / 8;
    const int matrix_row = lane % 8;
    const T* q_w = q_s + (warp_row + (matrix % 2) * 8 + matrix_row) * kStride + (matrix / 2) * 8;

    // One row tile per warp: Q stays in registers. Two: Q fragments are re-read per tile (registers
    // go to the second tile's scores and output instead).
    uint32_t q_frag[M == 1 ? D / 16 : 1][4];
    if (M == 1 && active) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) load_matrices(q_frag[M == 1 ? kk : 0], q_w + kk * 16);
    }

    float out[M][D / 8][4];
    float row_max[M][2];
    float row_sum[M][2];  // this lane's part; the row's 4 lanes are summed at the end
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) out[m][n][0] = out[m][n][1] = out[m][n][2] = out[m][n][3] = 0.0f;
        row_max[m][0] = row_max[m][1] = -INFINITY;
        row_sum[m][0] = row_sum[m][1] = 0.0f;
    }

    for (int i = 0; i < tiles; ++i) {
        const int tile = key_begin + i * kKeys;
        const int stage = i % 2;
        if (i + 1 < tiles) {
            const int next = tile + kKeys;
            const int valid = min(kKeys, key_end - next);
            load_tile<T, D, kKeys>(k_s + (1 - stage) * kTile, keys + int64_t(next) * D, valid);
            load_tile<T, D, kKeys>(v_s + (1 - stage) * kTile, values + int64_t(next) * D, valid);
            commit_copies();
            wait_copies<1>();
        } else {
            wait_copies<0>();
        }
        __syncthreads();
        if (active) {
            const T* k_tile = k_s + stage * kTile;
            const T* v_tile = v_s + stage * kTile;
            // S[16 M, 64] = Q_w[16 M, D] K_tile^T: 8 column blocks of 8 keys per row tile
            float score[M][kKeys / 8][4];
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int j = 0; j < kKeys / 8; ++j) score[m][j][0] = score[m][j][1] = score[m][j][2] = score[m][j][3] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[M][4];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    if constexpr (M == 1) {
#pragma unroll
                        for (int x = 0; x < 4; ++x) a[m][x] = q_frag[kk][x];
                    } else {
                        load_matrices(a[m], q_w + m * kRowsPerTile * kStride + kk * 16);
                    }
                }
#pragma unroll
                for (int j = 0; j < kKeys / 8; j += 2) {
                    uint32_t b[4];
                    load_matrices(b, k_tile + ((j + matrix / 2) * 8 + matrix_row) * kStride + kk * 16 +
                                         (matrix % 2) * 8);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        mma<T>(score[m][j], a[m], b[0], b[1]);
                        mma<T>(score[m][j + 1], a[m], b[2], b[3]);
                    }
                }
            }

            // Scale into the log2 domain; hide keys past the split and tree keys a node does not see.
            const int tile_keys = min(kKeys, key_end - tile);
            const bool every_key_visible = tile_keys == kKeys && tile + kKeys <= prefix;
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = e / 2;
                        float x = score[m][j][e] * args.scale_log2;
                        if (!every_key_visible) {
                            const int column = j * 8 + 2 * t + e % 2;
                            const int key = tile + column;
                            bool visible = column < tile_keys;
                            if (visible && key >= prefix) {  // a tree key: this row's node must see it
                                const int group_row = row0 + warp_row + m * kRowsPerTile + g + 8 * r;
                                const int node = group_row < args.group_rows ? group_row % args.num_tree : 0;
                                const int tree_key = key - prefix;
                                visible = (args.tree_mask[int64_t(node) * args.mask_words + tree_key / 32] >>
                                           (tree_key % 32)) & 1u;
                            }
                            if (!visible) x = -INFINITY;
                        }
                        score[m][j][e] = x;
                        tile_max[r] = fmaxf(tile_max[r], x);
                    }
                }
                float correction[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
                    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
                    const float new_max = fmaxf(row_max[m][r], tile_max[r]);
                    // a row that has seen nothing yet keeps max -inf, sum 0 and output 0
                    correction[r] = new_max == -INFINITY ? 1.0f : exp2f(row_max[m][r] - new_max);
                    row_max[m][r] = new_max;
                }
                float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = e / 2;
                        const float p = row_max[m][r] == -INFINITY ? 0.0f : exp2f(score[m][j][e] - row_max[m][r]);
                        score[m][j][e] = p;
                        tile_sum[r] += p;
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; ++r) row_sum[m][r] = row_sum[m][r] * correction[r] + tile_sum[r];
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    out[m][n][0] *= correction[0];
                    out[m][n][1] *= correction[0];
                    out[m][n][2] *= correction[1];
                    out[m][n][3] *= correction[1];
                }
            }

            // O_w[16 M, D] += P[16 M, 64] V_tile[64, D]; P's A fragments are the score registers.
#pragma unroll
            for (int kk = 0; kk < kKeys / 16; ++kk) {
                uint32_t p[M][4];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    p[m][0] = pack<T>(score[m][2 * kk][0], score[m][2 * kk][1]);
                    p[m][1] = pack<T>(score[m][2 * kk][2], score[m][2 * kk][3]);
                    p[m][2] = pack<T>(score[m][2 * kk + 1][0], score[m][2 * kk + 1][1]);
                    p[m][3] = pack<T>(score[m][2 * kk + 1][2], score[m][2 * kk + 1][3]);
                }
#pragma unroll
                for (int n = 0; n < D / 8; n += 2) {
                    uint32_t b[4];
                    load_matrices_transposed(b, v_tile + (kk * 16 + (matrix % 2) * 8 + matrix_row) * kStride +
                                                    n * 8 + (matrix / 2) * 8);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        mma<T>(out[m][n], p[m], b[0], b[1]);
                        mma<T>(out[m][n + 1], p[m], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before the next prefetch overwrites it
    }

#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_sum[m][r] += __shfl_xor_sync(0xffffffffu, row_sum[m][r], 1);
            row_sum[m][r] += __shfl_xor_sync(0xffffffffu, row_sum[m][r], 2);
        }
    }
    if (!active) return;
    const int64_t out_row0 = int64_t(split) * args.total_rows + int64_t(kv_head) * args.group_rows + row0;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int block_row = warp_row + m * kRowsPerTile + g + 8 * r;
            if (block_row >= rows_here) continue;
            const int64_t row = out_row0 + block_row;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                *reinterpret_cast<float2*>(args.partial_out + row * D + n * 8 + 2 * t) =
                    make_float2(out[m][n][2 * r], out[m][n][2 * r + 1]);
            }
            if (t == 0) {
                args.partial_max[row] = row_max[m][r];
                args.partial_sum[row] = row_sum[m][r];
            }
        }
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

// Shared memory a block may opt in to on the current GPU (read once per process).
int shared_memory_optin() {
    static const int bytes = [] {
        int device = 0;
        int value = 0;
        if (cudaGetDevice(&device) != cudaSuccess ||
            cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
            return 0;
        }
        return value;
    }();
    return bytes;
}

// The row tiles per warp `set_tree_row_tiles` forced (0: none), read at every launch.
std::atomic<int>& forced_row_tiles() {
    static std::atomic<int> forced{0};
    return forced;
}

// Row tiles per warp for this many query rows per KV head: two where they pay and fit the GPU's
// shared memory. The kernel setting tree_row_tiles = 1|2 forces one choice (docs/kernels.md compares
// them).
int row_tiles_per_warp(int group_rows, int head_dim) {
    const int forced = forced_row_tiles().load(std::memory_order_relaxed);
    const size_t two_tiles = head_dim == 64 ? Layout<64, 2>::total : Layout<128, 2>::total;
    const bool two_fit = two_tiles <= static_cast<size_t>(shared_memory_optin());
    if (forced == 1 || (forced == 2 && two_fit)) return forced;
    return group_rows >= kTwoTilesFromRows && two_fit ? 2 : 1;
}

template <typename T, int D, int M>
cudaError_t launch_split(const SplitArgs& args, dim3 grid, cudaStream_t stream) {
    const size_t smem = Layout<D, M>::total;
    cudaError_t status = cudaFuncSetAttribute(tree_attention_split_kernel<T, D, M>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return status;
    tree_attention_split_kernel<T, D, M><<<grid, kThreads, smem, stream>>>(args);
    return cudaGetLastError();
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

    const int tiles_per_warp = row_tiles_per_warp(group_rows, D);
    const dim3 grid(ceil_div(group_rows, block_rows(tiles_per_warp)), splits, p.num_kv_heads);
    cudaError_t status = tiles_per_warp == 2 ? launch_split<T, D, 2>(args, grid, stream)
                                             : launch_split<T, D, 1>(args, grid, stream);
    if (status != cudaSuccess) return status;
    tree_attention_combine_kernel<T, D><<<total_rows, D, 0, stream>>>(
        args.partial_out, args.partial_max, args.partial_sum, static_cast<T*>(p.output), splits, total_rows);
    return cudaGetLastError();
}

}  // namespace

void set_tree_row_tiles(int32_t tiles) { forced_row_tiles().store(tiles, std::memory_order_relaxed); }

size_t tree_attention_shared_bytes(int32_t head_dim) {  // what the kernel needs at least (one row tile)
    return head_dim == 64 ? Layout<64, 1>::total : head_dim == 128 ? Layout<128, 1>::total : 0;
}

int32_t tree_attention_splits(const TreeAttentionParams& params, int32_t num_sms) {
    const int group_rows = params.num_heads / std::max(1, params.num_kv_heads) * params.num_tree;
    const int rows_per_block = block_rows(row_tiles_per_warp(group_rows, params.head_dim));
    const int blocks_per_split = std::max(1, ceil_div(group_rows, rows_per_block) * params.num_kv_heads);
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
