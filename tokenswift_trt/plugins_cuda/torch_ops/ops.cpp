// Torch bindings of the CUDA kernels. kernels/ops.py compiles this file with
// torch.utils.cpp_extension and registers the functions as the CUDA implementations of
// torch.ops.tokenswift.tree_attention, torch.ops.tokenswift.kv_importance_select,
// torch.ops.tokenswift.add_rms_norm, torch.ops.tokenswift.rotary_qk, torch.ops.tokenswift.silu_mul and
// torch.ops.tokenswift.cascade_tail.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "tokenswift_kernels.h"

namespace {

tokenswift::DataType element_type(const at::Tensor& tensor) {
    TORCH_CHECK(tensor.scalar_type() == at::kHalf || tensor.scalar_type() == at::kBFloat16,
                "tokenswift kernels take float16 or bfloat16 tensors, got ", tensor.scalar_type());
    return tensor.scalar_type() == at::kHalf ? tokenswift::DataType::kFloat16 : tokenswift::DataType::kBFloat16;
}

// A cache view [kv_heads, length, head_dim]: rows contiguous, heads any (equal) stride apart.
void check_cache(const at::Tensor& cache, const char* name) {
    TORCH_CHECK(cache.is_cuda() && cache.dim() == 3, name, " must be a CUDA tensor [kv_heads, length, head_dim]");
    TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == cache.size(2), name,
                " rows must be contiguous ([kv_heads, length, head_dim] with unit stride inside a head)");
}

// Same device, dtype and head_dim as `reference`; equal shapes when `same_shape`.
void check_like(const at::Tensor& tensor, const at::Tensor& reference, const char* name, bool same_shape) {
    TORCH_CHECK(tensor.device() == reference.device(), name, " must be on ", reference.device());
    TORCH_CHECK(tensor.scalar_type() == reference.scalar_type(), name, " must be ", reference.scalar_type());
    TORCH_CHECK(tensor.size(-1) == reference.size(-1), name, " must have head_dim ", reference.size(-1));
    TORCH_CHECK(!same_shape || tensor.sizes() == reference.sizes(), name, " must be shaped like ", reference.sizes());
}

int multiprocessors() {
    int device = 0;
    int count = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
}

void run_tree_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& tree_mask, double scale, at::Tensor& output,
                        const int32_t* prefix_length_device) {
    check_cache(keys, "keys");
    check_cache(values, "values");
    TORCH_CHECK(query.is_cuda() && query.dim() == 3 && query.is_contiguous(),
                "query must be a contiguous CUDA tensor [heads, T, head_dim]");
    TORCH_CHECK(keys.strides() == values.strides(), "keys and values must share strides");
    check_like(keys, query, "keys", false);
    check_like(values, keys, "values", true);
    TORCH_CHECK(query.size(0) % keys.size(0) == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(keys.size(1) >= query.size(1), "keys must include the tree's own T positions");
    TORCH_CHECK(output.sizes() == query.sizes() && output.is_contiguous() &&
                    output.scalar_type() == query.scalar_type(),
                "output must be contiguous and shaped like query");
    const int64_t num_tree = query.size(1);
    TORCH_CHECK(tree_mask.device() == query.device() && tree_mask.scalar_type() == at::kInt && tree_mask.is_contiguous() &&
                    tree_mask.dim() == 2 && tree_mask.size(0) == num_tree &&
                    tree_mask.size(1) == tokenswift::tree_mask_words(static_cast<int32_t>(num_tree)),
                "tree_mask must be a contiguous int32 CUDA tensor [T, ceil(T / 32)]");
    const c10::cuda::CUDAGuard guard(query.device());
    tokenswift::TreeAttentionParams params;
    params.dtype = element_type(query);
    params.query = query.data_ptr();
    params.keys = keys.data_ptr();
    params.values = values.data_ptr();
    params.tree_mask = reinterpret_cast<const uint32_t*>(tree_mask.data_ptr<int32_t>());
    params.output = output.data_ptr();
    params.kv_head_stride = keys.stride(0);
    params.num_heads = static_cast<int32_t>(query.size(0));
    params.num_kv_heads = static_cast<int32_t>(keys.size(0));
    params.head_dim = static_cast<int32_t>(query.size(2));
    params.num_tree = static_cast<int32_t>(num_tree);
    params.key_length = static_cast<int32_t>(keys.size(1));
    params.scale = static_cast<float>(scale);
    params.prefix_length_device = prefix_length_device;
    const int sms = multiprocessors();
    params.num_splits = tokenswift::tree_attention_splits(params, sms);
    const size_t bytes = tokenswift::tree_attention_workspace_size(params, params.num_splits);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, query.options().dtype(at::kByte));
    const cudaError_t status = tokenswift::tree_attention(params, workspace.data_ptr(), bytes, sms,
                                                          c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift tree_attention failed: ", cudaGetErrorString(status),
                " (head_dim must be 64 or 128, T at most 256, heads a multiple of kv_heads, and the GPU must allow ",
                tokenswift::tree_attention_shared_bytes(params.head_dim), " bytes of shared memory per block)");
}

void tree_attention_into(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& tree_mask, double scale, at::Tensor& output) {
    run_tree_attention(query, keys, values, tree_mask, scale, output, nullptr);
}

at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& tree_mask, double scale) {
    at::Tensor output = at::empty_like(query);
    run_tree_attention(query, keys, values, tree_mask, scale, output, nullptr);
    return output;
}

// keys/values span a cache's whole capacity; the tree's K/V sit at [prefix, prefix + T) with
// prefix read on the device (an int32 CUDA scalar), so one CUDA graph serves every context length.
at::Tensor tree_attention_static(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& tree_mask, const at::Tensor& prefix_length, double scale) {
    TORCH_CHECK(prefix_length.is_cuda() && prefix_length.scalar_type() == at::kInt && prefix_length.numel() == 1,
                "prefix_length must be an int32 CUDA scalar");
    at::Tensor output = at::empty_like(query);
    run_tree_attention(query, keys, values, tree_mask, scale, output, prefix_length.data_ptr<int32_t>());
    return output;
}

// Selection, plus the K/V gather when out_keys/out_values are given (both or neither).
at::Tensor run_kv_select(const at::Tensor& keys, const at::Tensor* values, const at::Tensor& query, int64_t keep,
                         int64_t sinks, at::Tensor* out_keys, at::Tensor* out_values) {
    check_cache(keys, "keys");
    TORCH_CHECK(query.is_cuda() && query.dim() == 2 && query.is_contiguous() &&
                    query.scalar_type() == keys.scalar_type(),
                "query must be a contiguous CUDA tensor [heads, head_dim] of the keys' dtype");
    check_like(query, keys, "query", false);
    TORCH_CHECK(query.size(0) % keys.size(0) == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(keep >= 1 && keep <= keys.size(1), "keep must be in [1, cached length]");
    const c10::cuda::CUDAGuard guard(keys.device());
    at::Tensor indices = at::empty({keys.size(0), keep}, keys.options().dtype(at::kInt));
    tokenswift::KvSelectParams params;
    params.dtype = element_type(keys);
    params.keys = keys.data_ptr();
    params.query = query.data_ptr();
    params.kv_head_stride = keys.stride(0);
    params.num_heads = static_cast<int32_t>(query.size(0));
    params.num_kv_heads = static_cast<int32_t>(keys.size(0));
    params.head_dim = static_cast<int32_t>(keys.size(2));
    params.length = static_cast<int32_t>(keys.size(1));
    params.keep = static_cast<int32_t>(keep);
    params.sinks = static_cast<int32_t>(sinks);
    params.indices = indices.data_ptr<int32_t>();
    if (out_keys != nullptr) {
        check_cache(*values, "values");
        check_cache(*out_keys, "out_keys");
        check_cache(*out_values, "out_values");
        TORCH_CHECK(keys.strides() == values->strides(), "keys and values must share strides");
        check_like(*values, keys, "values", true);
        check_like(*out_keys, keys, "out_keys", false);
        check_like(*out_values, *out_keys, "out_values", true);
        TORCH_CHECK(out_keys->size(0) == keys.size(0) && out_keys->size(1) >= keep &&
                        out_keys->strides() == out_values->strides(),
                    "out_keys/out_values must be [kv_heads, >= keep, head_dim] and share strides");
        TORCH_CHECK(out_keys->data_ptr() != keys.data_ptr() && out_values->data_ptr() != values->data_ptr(),
                    "the gather target must not be the source cache");
        params.values = values->data_ptr();
        params.out_keys = out_keys->data_ptr();
        params.out_values = out_values->data_ptr();
        params.out_head_stride = out_keys->stride(0);
    }
    const size_t bytes = tokenswift::kv_select_workspace_size(params);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, keys.options().dtype(at::kByte));
    const cudaError_t status =
        tokenswift::kv_importance_select(params, workspace.data_ptr(), bytes, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift kv_importance_select failed: ", cudaGetErrorString(status));
    return indices.to(at::kLong);
}

at::Tensor kv_importance_select(const at::Tensor& keys, const at::Tensor& query, int64_t keep, int64_t sinks) {
    if (keep >= keys.size(1)) {
        return at::arange(keys.size(1), keys.options().dtype(at::kLong)).repeat({keys.size(0), 1});
    }
    return run_kv_select(keys, nullptr, query, keep, sinks, nullptr, nullptr);
}

// Fused select + gather into preallocated partial-cache views (what the TensorRT plugin does).
at::Tensor kv_importance_select_gather(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& query,
                                       int64_t keep, int64_t sinks, at::Tensor& out_keys, at::Tensor& out_values) {
    return run_kv_select(keys, &values, query, keep, sinks, &out_keys, &out_values);
}

// (x + delta, RMSNorm of it) in one kernel; delta may be undefined (None): a plain norm.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& weight, double eps) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CUDA tensor [rows, hidden]");
    TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden]");
    check_like(weight, x, "weight", false);
    const bool has_delta = delta.has_value() && delta->defined();
    if (has_delta) {
        TORCH_CHECK(delta->is_contiguous(), "delta must be contiguous");
        check_like(*delta, x, "delta", true);
    }
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor sum_out = at::empty_like(x);
    at::Tensor normed = at::empty_like(x);
    tokenswift::RmsNormParams params;
    params.dtype = element_type(x);
    params.x = x.data_ptr();
    params.delta = has_delta ? delta->data_ptr() : nullptr;
    params.weight = weight.data_ptr();
    params.sum_out = sum_out.data_ptr();
    params.normed = normed.data_ptr();
    params.rows = static_cast<int32_t>(x.size(0));
    params.hidden = static_cast<int32_t>(x.size(1));
    params.eps = static_cast<float>(eps);
    const cudaError_t status = tokenswift::add_rms_norm(params, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift add_rms_norm failed: ", cudaGetErrorString(status));
    return {sum_out, normed};
}

// Rotary embedding of q [heads, T, D] and k [kv_heads, T, D] (any head / token strides, last dim
// contiguous) with cos/sin [T, D] -> contiguous rotated copies.
std::vector<at::Tensor> rotary_qk(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                                  const at::Tensor& sin) {
    TORCH_CHECK(query.is_cuda() && query.dim() == 3 && query.stride(2) == 1,
                "query must be a CUDA tensor [heads, T, head_dim] with a contiguous last dimension");
    TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.size(1) == query.size(1),
                "key must be [kv_heads, T, head_dim] with a contiguous last dimension");
    check_like(key, query, "key", false);
    TORCH_CHECK(query.size(2) % 2 == 0, "head_dim must be even");
    const at::Tensor cos_rows = cos.contiguous();
    const at::Tensor sin_rows = sin.contiguous();
    for (const at::Tensor* table : {&cos_rows, &sin_rows}) {
        TORCH_CHECK(table->dim() == 2 && table->size(0) == query.size(1) && table->size(1) == query.size(2),
                    "cos and sin must be [T, head_dim]");
        check_like(*table, query, "cos/sin", false);
    }
    const c10::cuda::CUDAGuard guard(query.device());
    at::Tensor query_out = at::empty(query.sizes(), query.options());
    at::Tensor key_out = at::empty(key.sizes(), key.options());
    tokenswift::RotaryParams params;
    params.dtype = element_type(query);
    params.query = query.data_ptr();
    params.key = key.data_ptr();
    params.query_head_stride = query.stride(0);
    params.query_token_stride = query.stride(1);
    params.key_head_stride = key.stride(0);
    params.key_token_stride = key.stride(1);
    params.cos = cos_rows.data_ptr();
    params.sin = sin_rows.data_ptr();
    params.query_out = query_out.data_ptr();
    params.key_out = key_out.data_ptr();
    params.num_heads = static_cast<int32_t>(query.size(0));
    params.num_kv_heads = static_cast<int32_t>(key.size(0));
    params.num_tokens = static_cast<int32_t>(query.size(1));
    params.head_dim = static_cast<int32_t>(query.size(2));
    const cudaError_t status = tokenswift::rotary(params, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift rotary failed: ", cudaGetErrorString(status));
    return {query_out, key_out};
}

// SiLU(gate) * up of a packed gate-up product [rows, 2 * inner] -> [rows, inner].
at::Tensor silu_mul(const at::Tensor& gate_up) {
    TORCH_CHECK(gate_up.is_cuda() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
                "gate_up must be a contiguous CUDA tensor [rows, 2 * inner]");
    const c10::cuda::CUDAGuard guard(gate_up.device());
    at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    tokenswift::SiluMulParams params;
    params.dtype = element_type(gate_up);
    params.gate_up = gate_up.data_ptr();
    params.out = out.data_ptr();
    params.rows = static_cast<int32_t>(gate_up.size(0));
    params.inner = static_cast<int32_t>(gate_up.size(1) / 2);
    const cudaError_t status = tokenswift::silu_mul(params, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift silu_mul failed: ", cudaGetErrorString(status));
    return out;
}

// The cascade's tree block and merge: query [heads, T, D] (contiguous), the layer's cache keys/values
// [kv_heads, capacity, D], tree_visible [T, T] bool, prefix_length 0-d int64, the prefix block's
// outputs [splits, kv_heads, rows, D] (query dtype, last dim contiguous) and log-sum-exps [splits,
// kv_heads, rows] (float32), offsets [splits + 1] int32 -> [heads, T, D].
at::Tensor cascade_tail(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& tree_visible, const at::Tensor& prefix_length, const at::Tensor& prefix_out,
                        const at::Tensor& prefix_lse, const at::Tensor& offsets, double scale) {
    TORCH_CHECK(query.is_cuda() && query.dim() == 3 && query.is_contiguous(),
                "query must be a contiguous CUDA tensor [heads, T, head_dim]");
    check_cache(keys, "keys");
    check_cache(values, "values");
    check_like(keys, query, "keys", false);
    check_like(values, keys, "values", true);
    TORCH_CHECK(keys.stride(0) == values.stride(0), "keys and values must share their head stride");
    const int64_t heads = query.size(0), tokens = query.size(1), kv_heads = keys.size(0);
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of the KV heads");
    TORCH_CHECK(tokens <= keys.size(1), "more tree tokens than cache slots");
    TORCH_CHECK(tokenswift::cascade_tail_supports(static_cast<int32_t>(query.size(2))), "head_dim must be 64, 128 or 256");
    TORCH_CHECK(tree_visible.scalar_type() == at::kBool && tree_visible.is_contiguous() && tree_visible.dim() == 2 &&
                    tree_visible.size(0) == tokens && tree_visible.size(1) == tokens,
                "tree_visible must be a contiguous bool tensor [T, T]");
    TORCH_CHECK(prefix_length.scalar_type() == at::kLong && prefix_length.numel() == 1, "prefix_length must be 0-d int64");
    const int64_t rows = heads / kv_heads * tokens;
    TORCH_CHECK(prefix_out.dim() == 4, "prefix_out must be [splits, kv_heads, rows, head_dim]");
    const int64_t splits = prefix_out.size(0);
    TORCH_CHECK(prefix_out.size(1) == kv_heads && prefix_out.size(2) == rows && prefix_out.stride(3) == 1,
                "prefix_out must be [splits, kv_heads, rows, head_dim] with a contiguous last dimension");
    check_like(prefix_out, query, "prefix_out", false);
    TORCH_CHECK(prefix_lse.scalar_type() == at::kFloat && prefix_lse.dim() == 3 && prefix_lse.size(0) == splits &&
                    prefix_lse.size(1) == kv_heads && prefix_lse.size(2) == rows,
                "prefix_lse must be float32 [splits, kv_heads, rows]");
    TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.numel() == splits + 1,
                "offsets must be contiguous int32 [splits + 1]");
    for (const at::Tensor* tensor : {&tree_visible, &prefix_length, &prefix_out, &prefix_lse, &offsets}) {
        TORCH_CHECK(tensor->device() == query.device(), "every input must be on ", query.device());
    }
    const c10::cuda::CUDAGuard guard(query.device());
    at::Tensor out = at::empty(query.sizes(), query.options());
    tokenswift::CascadeTailParams params;
    params.dtype = element_type(query);
    params.query = query.data_ptr();
    params.keys = keys.data_ptr();
    params.values = values.data_ptr();
    params.cache_head_stride = keys.stride(0);
    params.tree_visible = tree_visible.data_ptr<bool>();
    params.prefix_length = prefix_length.data_ptr<int64_t>();
    params.prefix_out = prefix_out.data_ptr();
    params.out_split_stride = prefix_out.stride(0);
    params.out_head_stride = prefix_out.stride(1);
    params.out_row_stride = prefix_out.stride(2);
    params.prefix_lse = prefix_lse.data_ptr<float>();
    params.lse_split_stride = prefix_lse.stride(0);
    params.lse_head_stride = prefix_lse.stride(1);
    params.lse_row_stride = prefix_lse.stride(2);
    params.offsets = offsets.data_ptr<int32_t>();
    params.out = out.data_ptr();
    params.num_heads = static_cast<int32_t>(heads);
    params.num_kv_heads = static_cast<int32_t>(kv_heads);
    params.num_tokens = static_cast<int32_t>(tokens);
    params.head_dim = static_cast<int32_t>(query.size(2));
    params.splits = static_cast<int32_t>(splits);
    params.scale = static_cast<float>(scale);
    const cudaError_t status = tokenswift::cascade_tail(params, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(status == cudaSuccess, "tokenswift cascade_tail failed: ", cudaGetErrorString(status));
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("tree_attention", &tree_attention, "tree-verify attention (see kernels/ops.py)");
    module.def("tree_attention_into", &tree_attention_into, "tree_attention writing into a given output");
    module.def("tree_attention_static", &tree_attention_static, "tree_attention with a device-side prefix length");
    module.def("set_tree_row_tiles", &tokenswift::set_tree_row_tiles,
               "tree_attention's row tiles per warp from now on (0: its own choice, 1 or 2: forced)");
    module.def("tree_attention_shared_bytes", &tokenswift::tree_attention_shared_bytes,
               "dynamic shared memory per block the tree-attention kernel needs for a head_dim");
    module.def("kv_importance_select", &kv_importance_select, "partial-cache position selection");
    module.def("kv_importance_select_gather", &kv_importance_select_gather, "selection + K/V gather");
    module.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (see kernels/ops.py)");
    module.def("rotary_qk", &rotary_qk, "rotary embedding of queries and keys (see kernels/ops.py)");
    module.def("silu_mul", &silu_mul, "SiLU(gate) * up of a packed gate-up product (see kernels/ops.py)");
    module.def("cascade_tail", &cascade_tail, "the FlashAttention cascade's tree block and merge (kernels/cascade.py)");
}
