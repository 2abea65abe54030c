// The whole decoder stack of a float32 Llama/Qwen2 engine for a few new tokens (an AR step or a tree
// verification, T <= TILED_MAX_ROWS) in one call: per layer RMSNorm, the fused Q/K/V product, rotary embedding,
// the K/V write into the cache's pending slots, attention, the output product and residual, RMSNorm,
// the fused gate/up product, SiLU(gate)·up, the down product and residual.
//
// Why: on a 135M model a CPU decode step's products take ~9 ms, but the ~25 PyTorch operations per
// layer around them (views, norms, rotary, cache writes, residual adds; each a Python call and an
// ATen dispatch) took ~12 ms more (SmolLM2, 30 layers, 2-core EPYC). Here they are plain loops over
// a few hundred floats. Products go through linear_cpu (batch-invariant); attention through the
// tree-attention kernel or ATen's SDPA, as model/decoder.py chooses; every per-row step here
// depends on its own row only, so a token's hidden state is the same bits in a step and in a tree.
#include "kernels_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTensorsPerLayer = 10;  // see decoder_cpu's `weights`

// out[t, :] = x[t, :] · rsqrt(mean(x[t, :]²) + eps) · weight  (the sum of squares in double)
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t size, double eps) {
    for (int64_t t = 0; t < rows; ++t) {
        const float* row = x + t * size;
        double squares = 0.0;
        for (int64_t i = 0; i < size; ++i) squares += static_cast<double>(row[i]) * row[i];
        const float inverse = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(size) + eps));
        for (int64_t i = 0; i < size; ++i) out[t * size + i] = weight[i] * (row[i] * inverse);
    }
}

// x[t, head, :] rotated in place: x·cos + rotate_half(x)·sin, cos/sin [T, D]
void rotate(float* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t dim, const float* cos,
            const float* sin) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < rows; ++t) {
        const float* c = cos + t * dim;
        const float* s = sin + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
            float* v = x + t * row_stride + h * dim;
            for (int64_t i = 0; i < half; ++i) {
                const float first = v[i], second = v[i + half];
                v[i] = first * c[i] - second * s[i];
                v[i + half] = second * c[i + half] + first * s[i + half];
            }
        }
    }
}

}  // namespace

at::Tensor decoder_batch_cpu(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                             const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& keys,
                             const std::vector<at::Tensor>& values, const std::vector<int64_t>& prefixes,
                             const std::vector<int64_t>& counts, const std::vector<at::Tensor>& attention,
                             const std::vector<int64_t>& modes, int64_t heads, int64_t kv_heads, double eps,
                             double scale, const at::Tensor& queries) {
    TORCH_CHECK(embeddings.scalar_type() == at::kFloat && embeddings.dim() == 2 && embeddings.is_contiguous(),
                "decoder: embeddings must be contiguous float32 [T, hidden]");
    const int64_t rows = embeddings.size(0), hidden = embeddings.size(1);
    TORCH_CHECK(weights.size() % kTensorsPerLayer == 0, "decoder: 10 tensors per layer");
    const int64_t layers = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
    const size_t segments = counts.size();
    TORCH_CHECK(segments > 0 && keys.size() == segments && values.size() == segments && prefixes.size() == segments &&
                    attention.size() == segments && modes.size() == segments,
                "decoder: one cache, prefix, row count, attention input and mode per segment");
    std::vector<int64_t> first(segments + 1, 0);  // each segment's first row
    for (size_t s = 0; s < segments; ++s) {
        const at::Tensor &k = keys[s], &v = values[s];
        TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.sizes() == k.sizes() && v.is_contiguous() &&
                        k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                    "decoder: keys/values must be contiguous float32 [layers, kv_heads, capacity, head_dim]");
        TORCH_CHECK(counts[s] >= 1 && k.size(0) == layers && k.size(1) == kv_heads &&
                        prefixes[s] + counts[s] <= k.size(2) && k.size(3) == keys[0].size(3),
                    "decoder: a cache does not fit these layers, heads and tokens");
        TORCH_CHECK(modes[s] >= 0 && modes[s] <= 2,
                    "decoder: mode 0 (SDPA, query heads folded), 1 (SDPA) or 2 (tree kernel)");
        first[s + 1] = first[s] + counts[s];
    }
    TORCH_CHECK(first[segments] == rows, "decoder: the segments' rows must add up to the embeddings' rows");
    const int64_t dim = keys[0].size(3), group = heads / kv_heads;
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == rows && cos.size(1) == dim,
                "decoder: cos/sin must be contiguous [T, head_dim]");
    const bool keep_queries = queries.defined() && queries.numel() > 0;
    TORCH_CHECK(!keep_queries || (queries.is_contiguous() && queries.numel() == layers * rows * q_width),
                "decoder: queries must be contiguous [layers, T, heads, head_dim]");

    at::Tensor x = embeddings.clone();  // [T, hidden] the residual stream
    at::Tensor normed = at::empty({rows, hidden}, x.options());
    at::Tensor merged = at::empty({rows, q_width}, x.options());  // [T, heads · D] every segment's attention
    float* x_data = x.data_ptr<float>();
    for (int64_t layer = 0; layer < layers; ++layer) {
        const at::Tensor* w = weights.data() + layer * kTensorsPerLayer;
        // attention block: products over every segment's rows at once (batch-invariant), attention per segment
        rms_norm(x_data, w[0].data_ptr<float>(), normed.data_ptr<float>(), rows, hidden, eps);
        at::Tensor qkv = linear_cpu(normed, w[1], w[2], qkv_width);  // [T, q + k + v]
        float* qkv_data = qkv.data_ptr<float>();
        rotate(qkv_data, rows, heads, qkv_width, dim, cos.data_ptr<float>(), sin.data_ptr<float>());
        rotate(qkv_data + q_width, rows, kv_heads, qkv_width, dim, cos.data_ptr<float>(), sin.data_ptr<float>());
        for (size_t s = 0; s < segments; ++s) {
            const int64_t count = counts[s], prefix = prefixes[s], row0 = first[s];
            const int64_t slot_stride = dim, head_stride = keys[s].size(2) * dim, layer_stride = kv_heads * head_stride;
            float* key_cache = keys[s].data_ptr<float>() + layer * layer_stride;
            float* value_cache = values[s].data_ptr<float>() + layer * layer_stride;
            at::Tensor query = at::empty({heads, count, dim}, x.options());  // [heads, T_s, D]
            float* q_data = query.data_ptr<float>();
            for (int64_t t = 0; t < count; ++t) {
                const float* row = qkv_data + (row0 + t) * qkv_width;
                for (int64_t h = 0; h < heads; ++h)
                    for (int64_t d = 0; d < dim; ++d) q_data[(h * count + t) * dim + d] = row[h * dim + d];
                for (int64_t h = 0; h < kv_heads; ++h) {
                    float* k_slot = key_cache + h * head_stride + (prefix + t) * slot_stride;
                    float* v_slot = value_cache + h * head_stride + (prefix + t) * slot_stride;
                    for (int64_t d = 0; d < dim; ++d) {
                        k_slot[d] = row[q_width + h * dim + d];
                        v_slot[d] = row[q_width + kv_width + h * dim + d];
                    }
                }
                if (keep_queries) {
                    float* kept = queries.data_ptr<float>() + (layer * rows + row0 + t) * q_width;
                    for (int64_t i = 0; i < q_width; ++i) kept[i] = row[i];
                }
            }
            const at::Tensor layer_keys = keys[s].select(0, layer).narrow(1, 0, prefix + count);  // [kv_heads, S, D]
            const at::Tensor layer_values = values[s].select(0, layer).narrow(1, 0, prefix + count);
            at::Tensor attended;  // [heads, T_s, D]
            if (modes[s] == 2) {
                attended = tree_attention_cpu(query, layer_keys, layer_values, attention[s], scale);
            } else if (modes[s] == 0) {  // row g·T + t of KV head h: query t of head h·group + g
                attended = at::scaled_dot_product_attention(query.view({1, kv_heads, group * count, dim}),
                                                            layer_keys.unsqueeze(0), layer_values.unsqueeze(0),
                                                            attention[s])
                               .view({heads, count, dim});
            } else {
                attended = at::scaled_dot_product_attention(query.unsqueeze(0), layer_keys.unsqueeze(0),
                                                            layer_values.unsqueeze(0), attention[s], 0.0, false,
                                                            std::nullopt, heads > kv_heads)
                               .squeeze(0);
            }
            merged.narrow(0, row0, count).copy_(attended.transpose(0, 1).reshape({count, q_width}));
        }
        at::Tensor projected = linear_cpu(merged, w[3], w[4], hidden);
        const float* p = projected.data_ptr<float>();
        for (int64_t i = 0; i < rows * hidden; ++i) x_data[i] += p[i];
        // MLP block
        rms_norm(x_data, w[5].data_ptr<float>(), normed.data_ptr<float>(), rows, hidden, eps);
        const int64_t both = w[6].size(0) * w[6].size(2);  // padded gate + up width of the packed weight
        const int64_t inner = w[8].size(1);               // the down product's input size
        TORCH_CHECK(both >= 2 * inner, "decoder: gate/up and down products do not match");
        at::Tensor gate_up = linear_cpu(normed, w[6], w[7], 2 * inner);  // [T, gate | up]
        at::Tensor activated = at::empty({rows, inner}, x.options());
        const float* gu = gate_up.data_ptr<float>();
        float* a = activated.data_ptr<float>();
        for (int64_t t = 0; t < rows; ++t)
            for (int64_t i = 0; i < inner; ++i) {
                const float g = gu[t * 2 * inner + i];  // SiLU(g) = g·sigmoid(g), no exp of a large argument
                const float e = std::exp(-std::fabs(g));
                const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
                a[t * inner + i] = g * sigmoid * gu[t * 2 * inner + inner + i];
            }
        at::Tensor down = linear_cpu(activated, w[8], w[9], hidden);
        const float* dn = down.data_ptr<float>();
        for (int64_t i = 0; i < rows * hidden; ++i) x_data[i] += dn[i];
    }
    return x;
}

at::Tensor decoder_cpu(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& weights, const at::Tensor& keys, const at::Tensor& values,
                       int64_t prefix, const at::Tensor& attention, int64_t mode, int64_t heads, int64_t kv_heads,
                       double eps, double scale, const at::Tensor& queries) {
    return decoder_batch_cpu(embeddings, cos, sin, weights, {keys}, {values}, {prefix}, {embeddings.size(0)},
                             {attention}, {mode}, heads, kv_heads, eps, scale, queries);
}

at::Tensor draft_chain_cpu(const at::Tensor& hidden, const at::Tensor& root_embedding, const std::vector<at::Tensor>& root,
                           const std::vector<at::Tensor>& layers, double eps) {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
                "draft chain: hidden must be contiguous float32 [rows, hidden]");
    TORCH_CHECK(root.size() == 0 || root.size() == 2 || root.size() == 4,
                "draft chain: root input is none, (norm, product) or (hidden norm, norm, up, down)");
    TORCH_CHECK(layers.size() % 3 == 0, "draft chain: 3 tensors per layer");
    const int64_t rows = hidden.size(0), size = hidden.size(1), count = static_cast<int64_t>(layers.size()) / 3;
    TORCH_CHECK(root.empty() || (root_embedding.sizes() == hidden.sizes() && root_embedding.is_contiguous() &&
                                 root_embedding.scalar_type() == at::kFloat),
                "draft chain: the root embedding must be contiguous float32 like hidden");
    const at::Tensor none = hidden.new_empty(0);
    at::Tensor state = hidden.clone();  // [rows, hidden], the chain's pre-norm state
    float* s = state.data_ptr<float>();
    at::Tensor normed = at::empty({rows, size}, hidden.options());
    if (root.size() == 2) {  // + U · rmsnorm_r(e)
        rms_norm(root_embedding.data_ptr<float>(), root[0].data_ptr<float>(), normed.data_ptr<float>(), rows, size, eps);
        const at::Tensor added = linear_cpu(normed, root[1], none, size);
        const float* a = added.data_ptr<float>();
        for (int64_t i = 0; i < rows * size; ++i) s[i] += a[i];
    } else if (root.size() == 4) {  // + D · silu(U · [rmsnorm_h(h); rmsnorm_r(e)])
        at::Tensor both = at::empty({rows, 2 * size}, hidden.options());
        at::Tensor part = at::empty({rows, size}, hidden.options());
        float* b = both.data_ptr<float>();
        rms_norm(s, root[0].data_ptr<float>(), part.data_ptr<float>(), rows, size, eps);
        for (int64_t t = 0; t < rows; ++t) std::copy_n(part.data_ptr<float>() + t * size, size, b + t * 2 * size);
        rms_norm(root_embedding.data_ptr<float>(), root[1].data_ptr<float>(), part.data_ptr<float>(), rows, size, eps);
        for (int64_t t = 0; t < rows; ++t)
            std::copy_n(part.data_ptr<float>() + t * size, size, b + t * 2 * size + size);
        const int64_t width = root[3].size(1);  // the down product's input size
        at::Tensor up = linear_cpu(both, root[2], none, width);
        float* u = up.data_ptr<float>();
        for (int64_t i = 0; i < rows * width; ++i) u[i] = u[i] / (1.0f + std::exp(-u[i]));  // SiLU
        const at::Tensor added = linear_cpu(up, root[3], none, size);
        const float* a = added.data_ptr<float>();
        for (int64_t i = 0; i < rows * size; ++i) s[i] += a[i];
    }
    at::Tensor out = at::empty({2, count, rows, size}, hidden.options());  // [states; normalised states]
    float* states = out.data_ptr<float>();
    float* outputs = states + count * rows * size;
    for (int64_t layer = 0; layer < count; ++layer) {  // s += W · rmsnorm_a(s); out = rmsnorm_b(s)
        const at::Tensor* w = layers.data() + 3 * layer;
        rms_norm(s, w[0].data_ptr<float>(), normed.data_ptr<float>(), rows, size, eps);
        const at::Tensor added = linear_cpu(normed, w[1], none, size);
        const float* a = added.data_ptr<float>();
        for (int64_t i = 0; i < rows * size; ++i) s[i] += a[i];
        std::copy_n(s, rows * size, states + layer * rows * size);
        rms_norm(s, w[2].data_ptr<float>(), outputs + layer * rows * size, rows, size, eps);
    }
    return out;
}
