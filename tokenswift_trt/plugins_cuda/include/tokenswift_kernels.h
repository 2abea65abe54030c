// C++ interface of the TokenSwift CUDA kernels, shared by the torch ops and the TensorRT plugins.
//
// Both kernels work on one sequence and one layer; every tensor is in device memory.
// Element types: fp16 or bf16 for activations and caches, fp32 accumulation inside.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace tokenswift {

enum class DataType : int32_t { kFloat16 = 0, kBFloat16 = 1 };

// Attention of T tree tokens over a cache: the first `prefix = key_length - num_tree` keys are
// visible to every tree token; the last num_tree keys are the tree's own, visible per tree_mask.
struct TreeAttentionParams {
    DataType dtype = DataType::kBFloat16;
    const void* query = nullptr;     // [num_heads, num_tree, head_dim], contiguous (rotary applied)
    const void* keys = nullptr;      // [num_kv_heads, key_length, head_dim]; rows contiguous, heads kv_head_stride apart
    const void* values = nullptr;    // same layout as keys
    const uint32_t* tree_mask = nullptr;  // [num_tree, mask_words]: bit j % 32 of word j / 32 in row i
                                          // is set when tree node i may attend to tree node j
    void* output = nullptr;          // [num_heads, num_tree, head_dim], contiguous, dtype
    int64_t kv_head_stride = 0;      // elements between consecutive KV heads (a cache's capacity * head_dim)
    int32_t num_heads = 0;           // query heads; a multiple of num_kv_heads (GQA)
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;            // 64 or 128
    int32_t num_tree = 0;            // 1 .. 256
    int32_t key_length = 0;          // prefix + num_tree
    float scale = 0.0f;              // softmax scale, usually 1 / sqrt(head_dim)
    int32_t num_splits = 0;          // blocks along the key dimension; 0 = tree_attention_splits()
    // When set (CUDA-graph replays), the prefix length is read on the device at launch: the keys
    // used are [0, *prefix_length_device + num_tree) and key_length is only the capacity bound
    // (splits and workspace are sized for it).
    const int32_t* prefix_length_device = nullptr;
};

inline int32_t tree_mask_words(int32_t num_tree) { return (num_tree + 31) / 32; }

// Split count used when params.num_splits == 0: enough blocks to fill `num_sms` multiprocessors.
// It never decreases as key_length grows, so a workspace sized for the longest context suffices.
int32_t tree_attention_splits(const TreeAttentionParams& params, int32_t num_sms);

// Dynamic shared memory one block needs for `head_dim` (0 when unsupported); the device must
// allow this much per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
size_t tree_attention_shared_bytes(int32_t head_dim);

// Row tiles per warp for every later launch in this process: 1 or 2 forces one, 0 (the default) lets
// the kernel choose by rows and shared memory (the kernel setting tree_row_tiles).
void set_tree_row_tiles(int32_t tiles);

// Bytes of scratch (fp32 partial outputs and softmax statistics) for `splits` splits.
size_t tree_attention_workspace_size(const TreeAttentionParams& params, int32_t splits);

// Checks the parameters, then launches on `stream`. The workspace must hold
// tree_attention_workspace_size(params, splits) bytes for the split count actually used.
cudaError_t tree_attention(const TreeAttentionParams& params, void* workspace, size_t workspace_bytes,
                           int32_t num_sms, cudaStream_t stream);

// Scores every cached key against the latest query (summed over the query heads of its KV group),
// keeps positions [0, sinks) and the (keep - sinks) best-scoring others (ties: lower position
// first), in ascending order, and gathers those K/V rows.
struct KvSelectParams {
    DataType dtype = DataType::kBFloat16;
    const void* keys = nullptr;      // [num_kv_heads, length, head_dim]; rows contiguous, heads kv_head_stride apart
    const void* values = nullptr;    // same layout; may be null (then nothing is gathered)
    const void* query = nullptr;     // [num_heads, head_dim], contiguous
    int64_t kv_head_stride = 0;
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t head_dim = 0;            // 64 or 128
    int32_t length = 0;              // cached positions to choose from
    int32_t keep = 0;                // 1 .. length
    int32_t sinks = 0;               // always-kept leading positions (clamped to keep)
    int32_t* indices = nullptr;      // out [num_kv_heads, keep], ascending
    void* out_keys = nullptr;        // out [num_kv_heads, keep, head_dim] rows, heads out_head_stride apart (may be null)
    void* out_values = nullptr;      // as out_keys (may be null)
    int64_t out_head_stride = 0;
};

// Bytes of scratch (fp32 scores) needed for `length` positions.
size_t kv_select_workspace_size(const KvSelectParams& params);

cudaError_t kv_importance_select(const KvSelectParams& params, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

// Residual add + RMSNorm of `rows` rows of `hidden` elements: sum_out = x + delta (delta may be null:
// a plain norm, sum_out = x), normed = weight * (sum_out * rsqrt(mean(sum_out^2) + eps)), rounded as
// the PyTorch composition it replaces (src/rms_norm.cu). Every tensor contiguous [rows, hidden].
struct RmsNormParams {
    DataType dtype = DataType::kBFloat16;
    const void* x = nullptr;
    const void* delta = nullptr;     // may be null
    const void* weight = nullptr;    // [hidden]
    void* sum_out = nullptr;         // must not alias x or delta
    void* normed = nullptr;
    int32_t rows = 0;
    int32_t hidden = 0;
    float eps = 1e-6f;
};

cudaError_t add_rms_norm(const RmsNormParams& params, cudaStream_t stream);

// Rotary embedding of a step's queries and keys in one launch (src/rotary.cu): out = x * cos +
// rotate_half(x) * sin, each product and the sum rounded to the element type as PyTorch rounds them.
struct RotaryParams {
    DataType dtype = DataType::kBFloat16;
    const void* query = nullptr;     // [num_heads, num_tokens, head_dim]: last dim contiguous, strides below
    const void* key = nullptr;       // [num_kv_heads, num_tokens, head_dim], likewise
    int64_t query_head_stride = 0;
    int64_t query_token_stride = 0;
    int64_t key_head_stride = 0;
    int64_t key_token_stride = 0;
    const void* cos = nullptr;       // [num_tokens, head_dim], contiguous
    const void* sin = nullptr;
    void* query_out = nullptr;       // [num_heads, num_tokens, head_dim], contiguous
    void* key_out = nullptr;         // [num_kv_heads, num_tokens, head_dim], contiguous
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t num_tokens = 0;
    int32_t head_dim = 0;            // even
};

cudaError_t rotary(const RotaryParams& params, cudaStream_t stream);

// SiLU(gate) * up of an MLP's packed gate-up product (src/silu_mul.cu), rounded as PyTorch's ops.
struct SiluMulParams {
    DataType dtype = DataType::kBFloat16;
    const void* gate_up = nullptr;   // [rows, 2 * inner], contiguous: gate, then up
    void* out = nullptr;             // [rows, inner], contiguous
    int32_t rows = 0;
    int32_t inner = 0;
};

cudaError_t silu_mul(const SiluMulParams& params, cudaStream_t stream);

// The FlashAttention cascade's tree block and log-sum-exp merge (src/cascade_tail.cu; kernels/cascade.py):
// per packed row (node t of query head h), attention over the tree's own keys at [prefix, prefix + T) of
// the cache through the ancestor mask, merged with the prefix block's per-range outputs and
// log-sum-exps; fp32 inside, the output rounded once.
struct CascadeTailParams {
    DataType dtype = DataType::kBFloat16;
    const void* query = nullptr;         // [num_heads, num_tokens, head_dim], contiguous
    const void* keys = nullptr;          // cache [num_kv_heads, capacity, head_dim], rows contiguous
    const void* values = nullptr;        // same layout as keys
    int64_t cache_head_stride = 0;       // elements between KV heads (keys and values alike)
    const bool* tree_visible = nullptr;  // [num_tokens, num_tokens], contiguous: node i may see node j
    const int64_t* prefix_length = nullptr;  // device scalar: committed keys; the tree's start
    const void* prefix_out = nullptr;    // [splits, num_kv_heads, rows, head_dim], element strides below
    int64_t out_split_stride = 0;
    int64_t out_head_stride = 0;
    int64_t out_row_stride = 0;
    const float* prefix_lse = nullptr;   // [splits, num_kv_heads, rows], element strides below
    int64_t lse_split_stride = 0;
    int64_t lse_head_stride = 0;
    int64_t lse_row_stride = 0;
    const int32_t* offsets = nullptr;    // [splits + 1] key-range bounds: a range with equal bounds is empty
    void* out = nullptr;                 // [num_heads, num_tokens, head_dim], contiguous
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    int32_t num_tokens = 0;              // T; rows = num_heads / num_kv_heads * T
    int32_t head_dim = 0;                // 64, 128 or 256
    int32_t splits = 0;
    float scale = 0.0f;
};

bool cascade_tail_supports(int32_t head_dim);
cudaError_t cascade_tail(const CascadeTailParams& params, cudaStream_t stream);

}  // namespace tokenswift
