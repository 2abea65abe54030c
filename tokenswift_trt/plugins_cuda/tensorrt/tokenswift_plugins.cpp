// TensorRT 10 plugins (IPluginV3) around the TokenSwift CUDA kernels declared in tokenswift_kernels.h.
//
//   TokenSwiftTreeAttention (namespace "tokenswift", version "1")
//     inputs   0 query     [num_heads, T, head_dim]             fp16 | bf16
//              1 keys      [num_kv_heads, key_length, head_dim] same type as query
//              2 values    [num_kv_heads, key_length, head_dim] same type as query
//              3 tree_mask [T, ceil(T / 32)]                    int32 (packed bits, read as uint32)
//     output   0           [num_heads, T, head_dim]             same type as query
//     fields   num_heads, num_kv_heads, head_dim (int32), scale (float32)
//
//   TokenSwiftKvSelect (namespace "tokenswift", version "1")
//     inputs   0 keys      [num_kv_heads, L, head_dim]          fp16 | bf16
//              1 values    [num_kv_heads, L, head_dim]          same type as keys
//              2 query     [num_heads, head_dim]                same type as keys
//     outputs  0 keys      [num_kv_heads, keep, head_dim]       same type as keys
//              1 values    [num_kv_heads, keep, head_dim]       same type as keys
//              2 indices   [num_kv_heads, keep]                 int32, ascending positions
//     fields   keep, sinks, num_heads, num_kv_heads, head_dim (int32)
//
// All tensors are linear (contiguous). T, key_length and L may be dynamic.
//
// TokenSwiftTreeAttention also serialises an int32 field "num_sms": the multiprocessor count that
// sized its workspace at build time. The runtime launches with the same count, so its split count
// always fits the workspace TensorRT reserved, even on a GPU with more SMs. It is not an ONNX
// attribute (the creator does not advertise it); when absent, the current device is queried.
//
// The library is loaded with IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, Python
// trt.get_plugin_registry().load_library); TensorRT finds the creators through getCreators() and
// hands over a logger through setLoggerFinder(), both exported at the end of this file.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include <NvInferRuntime.h>

#include "tokenswift_kernels.h"

namespace tokenswift {
namespace trt {
namespace {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IErrorRecorder;
using nvinfer1::IExprBuilder;
using nvinfer1::ILogger;
using nvinfer1::ILoggerFinder;
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginCreatorV3One;
using nvinfer1::IPluginResourceContext;
using nvinfer1::IPluginV3;
using nvinfer1::IPluginV3OneBuild;
using nvinfer1::IPluginV3OneCore;
using nvinfer1::IPluginV3OneRuntime;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;
using nvinfer1::TensorRTPhase;

constexpr char kPluginNamespace[] = "tokenswift";
constexpr char kPluginVersion[] = "1";
constexpr char kNumSmsField[] = "num_sms";
constexpr int32_t kMaxTreeTokens = 256;  // largest num_tree the tree-attention kernel accepts

// ---------------------------------------------------------------------------------------------
// Logging: TensorRT passes a logger finder to the library when it loads it (setLoggerFinder).

std::atomic<ILoggerFinder*> gLoggerFinder{nullptr};

void logMessage(ILogger::Severity severity, char const* where, char const* what) noexcept {
    ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger == nullptr) {
        return;
    }
    try {
        std::string const message = std::string("[tokenswift] ") + where + ": " + what;
        logger->log(severity, message.c_str());
    } catch (...) {
        logger->log(severity, what);
    }
}

void logError(char const* where, char const* what) noexcept { logMessage(ILogger::Severity::kERROR, where, what); }

// ---------------------------------------------------------------------------------------------
// Helpers shared by both plugins.

// Multiprocessor count of the current device, cached per device; 0 if it cannot be queried.
int32_t currentDeviceSmCount() noexcept {
    constexpr int kCachedDevices = 64;
    static std::array<std::atomic<int32_t>, kCachedDevices> cache{};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        return 0;
    }
    std::atomic<int32_t>* slot = device >= 0 && device < kCachedDevices ? &cache[static_cast<size_t>(device)] : nullptr;
    int32_t const cached = slot != nullptr ? slot->load(std::memory_order_relaxed) : 0;
    if (cached > 0) {
        return cached;
    }
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
        return 0;
    }
    if (slot != nullptr) {
        slot->store(count, std::memory_order_relaxed);
    }
    return count;
}

bool isActivationType(DataType type) { return type == DataType::kHALF || type == DataType::kBF16; }

tokenswift::DataType toKernelType(DataType type) {
    return type == DataType::kHALF ? tokenswift::DataType::kFloat16 : tokenswift::DataType::kBFloat16;
}

// True when a build-time extent is unknown (-1) or equals the expected value.
bool extentMatches(int64_t extent, int64_t expected) { return extent < 0 || extent == expected; }

bool fitsInt32(int64_t value) { return value >= 0 && value <= std::numeric_limits<int32_t>::max(); }

bool validHeads(int32_t numHeads, int32_t numKvHeads) {
    return numKvHeads >= 1 && numHeads >= numKvHeads && numHeads % numKvHeads == 0;
}

bool validHeadDim(int32_t headDim) { return headDim == 64 || headDim == 128; }

// Reads scalar fields from a PluginFieldCollection. Each lookup checks presence, type and length;
// the first problem is logged and remembered, so a creator can read everything and test ok() once.
class FieldReader {
public:
    FieldReader(PluginFieldCollection const* fields, char const* pluginName) : mFields(fields), mPluginName(pluginName) {
        if (fields == nullptr || (fields->nbFields > 0 && fields->fields == nullptr)) {
            fail("no plugin fields were given");
        }
    }

    bool ok() const { return mOk; }

    bool has(char const* name) const { return find(name) != nullptr; }

    // int32 field; int64 values that fit in int32 are accepted too.
    int32_t getInt(char const* name) {
        PluginField const* field = findChecked(name);
        if (field == nullptr) {
            return 0;
        }
        if (field->type == PluginFieldType::kINT32) {
            int32_t value = 0;
            std::memcpy(&value, field->data, sizeof(value));
            return value;
        }
        if (field->type == PluginFieldType::kINT64) {
            int64_t value = 0;
            std::memcpy(&value, field->data, sizeof(value));
            if (value >= std::numeric_limits<int32_t>::min() && value <= std::numeric_limits<int32_t>::max()) {
                return static_cast<int32_t>(value);
            }
            failField(name, "is out of the int32 range");
            return 0;
        }
        failField(name, "must be an int32 field (PluginFieldType::kINT32)");
        return 0;
    }

    // float32 field; float64 values are accepted too.
    float getFloat(char const* name) {
        PluginField const* field = findChecked(name);
        if (field == nullptr) {
            return 0.0F;
        }
        if (field->type == PluginFieldType::kFLOAT32) {
            float value = 0.0F;
            std::memcpy(&value, field->data, sizeof(value));
            return value;
        }
        if (field->type == PluginFieldType::kFLOAT64) {
            double value = 0.0;
            std::memcpy(&value, field->data, sizeof(value));
            return static_cast<float>(value);
        }
        failField(name, "must be a float32 field (PluginFieldType::kFLOAT32)");
        return 0.0F;
    }

    // Records a failed value check made by the caller.
    void require(bool condition, char const* what) {
        if (!condition) {
            fail(what);
        }
    }

private:
    // The last field with this name (later fields override earlier ones).
    PluginField const* find(char const* name) const {
        if (mFields == nullptr || mFields->fields == nullptr) {
            return nullptr;
        }
        PluginField const* found = nullptr;
        for (int32_t i = 0; i < mFields->nbFields; ++i) {
            PluginField const& field = mFields->fields[i];
            if (field.name != nullptr && std::strcmp(field.name, name) == 0) {
                found = &field;
            }
        }
        return found;
    }

    PluginField const* findChecked(char const* name) {
        PluginField const* field = find(name);
        if (field == nullptr) {
            failField(name, "is missing");
            return nullptr;
        }
        if (field->data == nullptr || field->length != 1) {
            failField(name, "must hold exactly one value");
            return nullptr;
        }
        return field;
    }

    void failField(char const* name, char const* problem) {
        if (!mOk) {
            return;
        }
        try {
            std::string const what = std::string("field \"") + name + "\" " + problem;
            fail(what.c_str());
        } catch (...) {
            fail(problem);
        }
    }

    void fail(char const* what) {
        if (mOk) {
            logError(mPluginName, what);
        }
        mOk = false;
    }

    PluginFieldCollection const* mFields;
    char const* mPluginName;
    bool mOk = true;
};

// ---------------------------------------------------------------------------------------------
// What both plugins share: the capability plumbing, naming, cloning, context attachment, error
// reporting and the serialised field collection. Derived provides kName, a copy constructor and
// appendFields(), which lists the fields to serialise.

template <typename Derived>
class PluginBase : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime {
public:
    // Derived provides kName, kNbInputs, kNbOutputs, shapeProblem(in, out) and appendFields(fields).
    // IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    IPluginV3* clone() noexcept override { return new (std::nothrow) Derived(static_cast<Derived const&>(*this)); }

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override { return Derived::kName; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneRuntime
    IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override {
        auto* copy = new (std::nothrow) Derived(static_cast<Derived const&>(*this));
        if (copy != nullptr) {
            copy->mErrorRecorder = context != nullptr ? context->getErrorRecorder() : nullptr;
        }
        return copy;
    }

    int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
        if (in == nullptr || out == nullptr || nbInputs != Derived::kNbInputs || nbOutputs != Derived::kNbOutputs) {
            return -1;
        }
        char const* problem = static_cast<Derived const*>(this)->shapeProblem(in, out);
        if (problem != nullptr) {
            logError(Derived::kName, problem);
            return -1;
        }
        return 0;
    }

    PluginFieldCollection const* getFieldsToSerialize() noexcept override {
        // Rebuilt on every call so the field pointers always refer to this object's members.
        try {
            mSerialFields.clear();
            static_cast<Derived*>(this)->appendFields(mSerialFields);
        } catch (...) {
            mSerialFields.clear();
        }
        mSerialCollection.nbFields = static_cast<int32_t>(mSerialFields.size());
        mSerialCollection.fields = mSerialFields.data();
        return &mSerialCollection;
    }

protected:
    PluginBase() = default;
    PluginBase(PluginBase const&) = default;
    PluginBase& operator=(PluginBase const&) = delete;

    // Reports a failed enqueue to the execution context's error recorder and the log; returns the
    // nonzero status enqueue() should return.
    int32_t enqueueFailed(char const* what, cudaError_t status = cudaErrorInvalidValue) const noexcept {
        try {
            std::string const message = std::string(what) + " (" + cudaGetErrorString(status) + ")";
            if (mErrorRecorder != nullptr) {
                mErrorRecorder->reportError(nvinfer1::ErrorCode::kFAILED_EXECUTION, message.c_str());
            }
            logError(Derived::kName, message.c_str());
        } catch (...) {
            logError(Derived::kName, what);
        }
        return status != cudaSuccess ? static_cast<int32_t>(status) : -1;
    }

private:
    IErrorRecorder* mErrorRecorder = nullptr;
    std::vector<PluginField> mSerialFields;
    PluginFieldCollection mSerialCollection{};
};

// ---------------------------------------------------------------------------------------------
// TokenSwiftTreeAttention

struct TreeAttentionFields {
    int32_t numHeads = 0;
    int32_t numKvHeads = 0;
    int32_t headDim = 0;
    float scale = 0.0F;
};

class TreeAttentionPlugin final : public PluginBase<TreeAttentionPlugin> {
public:
    friend class PluginBase<TreeAttentionPlugin>;  // onShapeChange calls shapeProblem
    static constexpr char const* kName = "TokenSwiftTreeAttention";
    static constexpr int32_t kNbInputs = 4;
    static constexpr int32_t kNbOutputs = 1;

    TreeAttentionPlugin(TreeAttentionFields const& fields, int32_t numSms)
        : mFields(fields), mNumSms(numSms > 0 ? numSms : currentDeviceSmCount()) {}
    TreeAttentionPlugin(TreeAttentionPlugin const&) = default;

    void appendFields(std::vector<PluginField>& out) {
        out.emplace_back("num_heads", &mFields.numHeads, PluginFieldType::kINT32, 1);
        out.emplace_back("num_kv_heads", &mFields.numKvHeads, PluginFieldType::kINT32, 1);
        out.emplace_back("head_dim", &mFields.headDim, PluginFieldType::kINT32, 1);
        out.emplace_back("scale", &mFields.scale, PluginFieldType::kFLOAT32, 1);
        out.emplace_back(kNumSmsField, &mNumSms, PluginFieldType::kINT32, 1);
    }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return kNbOutputs; }

    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (inOut == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 ||
            pos >= kNbInputs + kNbOutputs) {
            return false;
        }
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) {
            return false;
        }
        if (pos == 3) {
            return desc.type == DataType::kINT32;
        }
        if (pos == 0) {
            return isActivationType(desc.type);
        }
        return desc.type == inOut[0].desc.type;  // keys, values and output follow the query
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != kNbOutputs || nbInputs != kNbInputs) {
            return -1;
        }
        outputTypes[0] = inputTypes[0];
        return 0;
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
                            DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept override {
        if (inputs == nullptr || outputs == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs ||
            inputs[0].nbDims != 3) {
            return -1;
        }
        outputs[0] = inputs[0];  // [num_heads, T, head_dim]
        return 0;
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                            int32_t nbOutputs) noexcept override {
        if (in == nullptr || out == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs) {
            return -1;
        }
        Dims const& query = in[0].desc.dims;
        Dims const& keys = in[1].desc.dims;
        Dims const& values = in[2].desc.dims;
        Dims const& mask = in[3].desc.dims;
        bool ok = query.nbDims == 3 && keys.nbDims == 3 && values.nbDims == 3 && mask.nbDims == 2;
        ok = ok && extentMatches(query.d[0], mFields.numHeads) && extentMatches(query.d[2], mFields.headDim);
        ok = ok && extentMatches(keys.d[0], mFields.numKvHeads) && extentMatches(keys.d[2], mFields.headDim);
        ok = ok && extentMatches(values.d[0], mFields.numKvHeads) && extentMatches(values.d[2], mFields.headDim);
        if (ok && query.d[1] >= 0) {
            ok = extentMatches(mask.d[0], query.d[1]) &&
                 extentMatches(mask.d[1], tree_mask_words(static_cast<int32_t>(query.d[1])));
        }
        if (!ok) {
            logError(kName,
                     "inputs must be query [num_heads, T, head_dim], keys and values [num_kv_heads, key_length, "
                     "head_dim], tree_mask [T, ceil(T / 32)], matching the num_heads/num_kv_heads/head_dim fields");
            return -1;
        }
        return 0;
    }

    size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t) const noexcept override {
        if (inputs == nullptr || nbInputs != kNbInputs || inputs[0].max.nbDims != 3 || inputs[1].max.nbDims != 3) {
            return 0;
        }
        // The split count grows with key_length but shrinks as T grows, so the scratch size is not
        // monotonic in T: take the largest over every T the profile allows, at the longest key_length.
        TreeAttentionParams params = baseParams();
        params.key_length = static_cast<int32_t>(std::min<int64_t>(inputs[1].max.d[1], std::numeric_limits<int32_t>::max()));
        int64_t const maxTree = std::min<int64_t>(inputs[0].max.d[1], kMaxTreeTokens);
        int64_t const minTree = std::max<int64_t>(inputs[0].min.d[1], 1);
        int32_t const sms = smCount();
        size_t bytes = 0;
        for (int64_t tree = minTree; tree <= maxTree; ++tree) {
            params.num_tree = static_cast<int32_t>(tree);
            bytes = std::max(bytes, tree_attention_workspace_size(params, tree_attention_splits(params, sms)));
        }
        return bytes;
    }

    // IPluginV3OneRuntime
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                    void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr) {
            return enqueueFailed("missing tensor descriptions or buffers");
        }
        char const* problem = shapeProblem(inputDesc, outputDesc);
        if (problem != nullptr) {
            return enqueueFailed(problem);
        }
        TreeAttentionParams params = baseParams();
        params.dtype = toKernelType(inputDesc[0].type);
        params.query = inputs[0];
        params.keys = inputs[1];
        params.values = inputs[2];
        params.tree_mask = static_cast<uint32_t const*>(inputs[3]);
        params.output = outputs[0];
        params.num_tree = static_cast<int32_t>(inputDesc[0].dims.d[1]);
        params.key_length = static_cast<int32_t>(inputDesc[1].dims.d[1]);
        params.kv_head_stride = int64_t(params.key_length) * params.head_dim;  // TensorRT inputs are contiguous
        if (params.num_tree == 0) {
            return 0;  // empty output
        }
        int32_t const sms = smCount();
        // What this call needs; getWorkspaceSize() reserved at least this much for any shape of the profile.
        size_t const bytes = tree_attention_workspace_size(params, tree_attention_splits(params, sms));
        cudaError_t const status = tree_attention(params, workspace, bytes, sms, stream);
        if (status != cudaSuccess) {
            return enqueueFailed("tree_attention failed (T must be 1..256 and key_length >= T)", status);
        }
        return 0;
    }

private:
    // The SM count the workspace is sized with; queried again if it was unknown at creation.
    int32_t smCount() const noexcept { return mNumSms > 0 ? mNumSms : currentDeviceSmCount(); }

    TreeAttentionParams baseParams() const {
        TreeAttentionParams params;
        params.num_heads = mFields.numHeads;
        params.num_kv_heads = mFields.numKvHeads;
        params.head_dim = mFields.headDim;
        params.scale = mFields.scale;
        params.num_splits = 0;
        return params;
    }

    // nullptr when the runtime shapes are consistent with each other and with the fields.
    char const* shapeProblem(PluginTensorDesc const* in, PluginTensorDesc const* out) const {
        Dims const& query = in[0].dims;
        Dims const& keys = in[1].dims;
        Dims const& values = in[2].dims;
        Dims const& mask = in[3].dims;
        Dims const& output = out[0].dims;
        if (query.nbDims != 3 || query.d[0] != mFields.numHeads || query.d[2] != mFields.headDim ||
            !fitsInt32(query.d[1])) {
            return "query must be [num_heads, T, head_dim]";
        }
        if (keys.nbDims != 3 || keys.d[0] != mFields.numKvHeads || keys.d[2] != mFields.headDim ||
            !fitsInt32(keys.d[1])) {
            return "keys must be [num_kv_heads, key_length, head_dim]";
        }
        if (values.nbDims != 3 || values.d[0] != keys.d[0] || values.d[1] != keys.d[1] || values.d[2] != keys.d[2]) {
            return "values must have the shape of keys";
        }
        if (mask.nbDims != 2 || mask.d[0] != query.d[1] ||
            mask.d[1] != tree_mask_words(static_cast<int32_t>(query.d[1]))) {
            return "tree_mask must be [T, ceil(T / 32)]";
        }
        if (output.nbDims != 3 || output.d[0] != query.d[0] || output.d[1] != query.d[1] ||
            output.d[2] != query.d[2]) {
            return "output must have the shape of query";
        }
        return nullptr;
    }

    TreeAttentionFields mFields;
    int32_t mNumSms;
};

// ---------------------------------------------------------------------------------------------
// TokenSwiftKvSelect

struct KvSelectFields {
    int32_t keep = 0;
    int32_t sinks = 0;
    int32_t numHeads = 0;
    int32_t numKvHeads = 0;
    int32_t headDim = 0;
};

class KvSelectPlugin final : public PluginBase<KvSelectPlugin> {
public:
    friend class PluginBase<KvSelectPlugin>;  // onShapeChange calls shapeProblem
    static constexpr char const* kName = "TokenSwiftKvSelect";
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 3;

    explicit KvSelectPlugin(KvSelectFields const& fields) : mFields(fields) {}
    KvSelectPlugin(KvSelectPlugin const&) = default;

    void appendFields(std::vector<PluginField>& out) {
        out.emplace_back("keep", &mFields.keep, PluginFieldType::kINT32, 1);
        out.emplace_back("sinks", &mFields.sinks, PluginFieldType::kINT32, 1);
        out.emplace_back("num_heads", &mFields.numHeads, PluginFieldType::kINT32, 1);
        out.emplace_back("num_kv_heads", &mFields.numKvHeads, PluginFieldType::kINT32, 1);
        out.emplace_back("head_dim", &mFields.headDim, PluginFieldType::kINT32, 1);
    }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return kNbOutputs; }

    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (inOut == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 ||
            pos >= kNbInputs + kNbOutputs) {
            return false;
        }
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) {
            return false;
        }
        if (pos == kNbInputs + 2) {
            return desc.type == DataType::kINT32;  // indices
        }
        if (pos == 0) {
            return isActivationType(desc.type);
        }
        return desc.type == inOut[0].desc.type;  // values, query and the gathered rows follow the keys
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != kNbOutputs || nbInputs != kNbInputs) {
            return -1;
        }
        outputTypes[0] = inputTypes[0];
        outputTypes[1] = inputTypes[0];
        outputTypes[2] = DataType::kINT32;
        return 0;
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
                            DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override {
        if (inputs == nullptr || outputs == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs ||
            inputs[0].nbDims != 3) {
            return -1;
        }
        auto const* keep = exprBuilder.constant(mFields.keep);
        if (keep == nullptr) {
            return -1;
        }
        for (int32_t i = 0; i < 2; ++i) {  // selected keys and values: [num_kv_heads, keep, head_dim]
            outputs[i].nbDims = 3;
            outputs[i].d[0] = inputs[0].d[0];
            outputs[i].d[1] = keep;
            outputs[i].d[2] = inputs[0].d[2];
        }
        outputs[2].nbDims = 2;  // indices: [num_kv_heads, keep]
        outputs[2].d[0] = inputs[0].d[0];
        outputs[2].d[1] = keep;
        return 0;
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                            int32_t nbOutputs) noexcept override {
        if (in == nullptr || out == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs) {
            return -1;
        }
        Dims const& keys = in[0].desc.dims;
        Dims const& values = in[1].desc.dims;
        Dims const& query = in[2].desc.dims;
        bool ok = keys.nbDims == 3 && values.nbDims == 3 && query.nbDims == 2;
        ok = ok && extentMatches(keys.d[0], mFields.numKvHeads) && extentMatches(keys.d[2], mFields.headDim);
        ok = ok && extentMatches(values.d[0], mFields.numKvHeads) && extentMatches(values.d[2], mFields.headDim);
        ok = ok && extentMatches(query.d[0], mFields.numHeads) && extentMatches(query.d[1], mFields.headDim);
        if (!ok) {
            logError(kName,
                     "inputs must be keys and values [num_kv_heads, L, head_dim] and query [num_heads, head_dim], "
                     "matching the num_heads/num_kv_heads/head_dim fields");
            return -1;
        }
        return 0;
    }

    size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs, DynamicPluginTensorDesc const*,
                            int32_t) const noexcept override {
        if (inputs == nullptr || nbInputs != kNbInputs || inputs[0].max.nbDims != 3) {
            return 0;
        }
        KvSelectParams params = baseParams();
        params.length = static_cast<int32_t>(std::min<int64_t>(inputs[0].max.d[1], std::numeric_limits<int32_t>::max()));
        return kv_select_workspace_size(params);  // grows with length, so the longest L covers every shape
    }

    // IPluginV3OneRuntime
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                    void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr) {
            return enqueueFailed("missing tensor descriptions or buffers");
        }
        char const* problem = shapeProblem(inputDesc, outputDesc);
        if (problem != nullptr) {
            return enqueueFailed(problem);
        }
        KvSelectParams params = baseParams();
        params.dtype = toKernelType(inputDesc[0].type);
        params.keys = inputs[0];
        params.values = inputs[1];
        params.query = inputs[2];
        params.length = static_cast<int32_t>(inputDesc[0].dims.d[1]);
        params.kv_head_stride = int64_t(params.length) * params.head_dim;  // TensorRT inputs are contiguous
        params.out_keys = outputs[0];
        params.out_values = outputs[1];
        params.indices = static_cast<int32_t*>(outputs[2]);
        params.out_head_stride = int64_t(params.keep) * params.head_dim;
        if (params.length < params.keep) {
            return enqueueFailed("the cache holds fewer positions (L) than keep");
        }
        cudaError_t const status =
            kv_importance_select(params, workspace, kv_select_workspace_size(params), stream);
        if (status != cudaSuccess) {
            return enqueueFailed("kv_importance_select failed", status);
        }
        return 0;
    }

private:
    KvSelectParams baseParams() const {
        KvSelectParams params;
        params.num_heads = mFields.numHeads;
        params.num_kv_heads = mFields.numKvHeads;
        params.head_dim = mFields.headDim;
        params.keep = mFields.keep;
        params.sinks = mFields.sinks;
        return params;
    }

    // nullptr when the runtime shapes are consistent with each other and with the fields.
    char const* shapeProblem(PluginTensorDesc const* in, PluginTensorDesc const* out) const {
        Dims const& keys = in[0].dims;
        Dims const& values = in[1].dims;
        Dims const& query = in[2].dims;
        if (keys.nbDims != 3 || keys.d[0] != mFields.numKvHeads || keys.d[2] != mFields.headDim ||
            !fitsInt32(keys.d[1])) {
            return "keys must be [num_kv_heads, L, head_dim]";
        }
        if (values.nbDims != 3 || values.d[0] != keys.d[0] || values.d[1] != keys.d[1] || values.d[2] != keys.d[2]) {
            return "values must have the shape of keys";
        }
        if (query.nbDims != 2 || query.d[0] != mFields.numHeads || query.d[1] != mFields.headDim) {
            return "query must be [num_heads, head_dim]";
        }
        for (int32_t i = 0; i < 2; ++i) {
            Dims const& rows = out[i].dims;
            if (rows.nbDims != 3 || rows.d[0] != mFields.numKvHeads || rows.d[1] != mFields.keep ||
                rows.d[2] != mFields.headDim) {
                return "selected keys and values must be [num_kv_heads, keep, head_dim]";
            }
        }
        if (out[2].dims.nbDims != 2 || out[2].dims.d[0] != mFields.numKvHeads || out[2].dims.d[1] != mFields.keep) {
            return "indices must be [num_kv_heads, keep]";
        }
        return nullptr;
    }

    KvSelectFields mFields;
};

// ---------------------------------------------------------------------------------------------
// Creators. getFieldNames() lists the fields a node must carry (for the ONNX parser: the node
// attributes it turns into PluginFields); createPlugin() rejects missing, mistyped or invalid ones.

template <size_t N>
class CreatorBase : public IPluginCreatorV3One {
public:
    PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }
    char const* getPluginVersion() const noexcept override { return kPluginVersion; }
    char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

protected:
    explicit CreatorBase(std::array<PluginField, N> const& fields) : mFields(fields) {
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.data();
    }

private:
    std::array<PluginField, N> mFields;
    PluginFieldCollection mCollection{};
};

class TreeAttentionCreator final : public CreatorBase<4> {
public:
    TreeAttentionCreator()
        : CreatorBase({PluginField("num_heads", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("num_kv_heads", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("head_dim", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("scale", nullptr, PluginFieldType::kFLOAT32, 1)}) {}

    char const* getPluginName() const noexcept override { return TreeAttentionPlugin::kName; }

    IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
        FieldReader reader(fc, TreeAttentionPlugin::kName);
        if (!reader.ok()) {
            return nullptr;
        }
        TreeAttentionFields fields;
        fields.numHeads = reader.getInt("num_heads");
        fields.numKvHeads = reader.getInt("num_kv_heads");
        fields.headDim = reader.getInt("head_dim");
        fields.scale = reader.getFloat("scale");
        if (!reader.ok()) {
            return nullptr;
        }
        reader.require(validHeads(fields.numHeads, fields.numKvHeads),
                       "num_kv_heads must be >= 1 and divide num_heads");
        reader.require(validHeadDim(fields.headDim), "head_dim must be 64 or 128");
        reader.require(std::isfinite(fields.scale) && fields.scale != 0.0F, "scale must be finite and nonzero");
        // The serialised SM count (runtime phase); 0 makes the plugin query the current device.
        int32_t const numSms = reader.has(kNumSmsField) ? reader.getInt(kNumSmsField) : 0;
        if (!reader.ok()) {
            return nullptr;
        }
        return new (std::nothrow) TreeAttentionPlugin(fields, numSms);
    }
};

class KvSelectCreator final : public CreatorBase<5> {
public:
    KvSelectCreator()
        : CreatorBase({PluginField("keep", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("sinks", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("num_heads", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("num_kv_heads", nullptr, PluginFieldType::kINT32, 1),
                       PluginField("head_dim", nullptr, PluginFieldType::kINT32, 1)}) {}

    char const* getPluginName() const noexcept override { return KvSelectPlugin::kName; }

    IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
        FieldReader reader(fc, KvSelectPlugin::kName);
        if (!reader.ok()) {
            return nullptr;
        }
        KvSelectFields fields;
        fields.keep = reader.getInt("keep");
        fields.sinks = reader.getInt("sinks");
        fields.numHeads = reader.getInt("num_heads");
        fields.numKvHeads = reader.getInt("num_kv_heads");
        fields.headDim = reader.getInt("head_dim");
        if (!reader.ok()) {
            return nullptr;
        }
        reader.require(fields.keep >= 1, "keep must be >= 1");
        reader.require(fields.sinks >= 0, "sinks must be >= 0");
        reader.require(validHeads(fields.numHeads, fields.numKvHeads),
                       "num_kv_heads must be >= 1 and divide num_heads");
        reader.require(validHeadDim(fields.headDim), "head_dim must be 64 or 128");
        if (!reader.ok()) {
            return nullptr;
        }
        return new (std::nothrow) KvSelectPlugin(fields);
    }
};

}  // namespace
}  // namespace trt
}  // namespace tokenswift

// ---------------------------------------------------------------------------------------------
// Entry points TensorRT looks up when it loads this library as a plugin library.

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    tokenswift::trt::gLoggerFinder.store(finder);
}

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators) {
    static tokenswift::trt::TreeAttentionCreator treeAttentionCreator;
    static tokenswift::trt::KvSelectCreator kvSelectCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&treeAttentionCreator, &kvSelectCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}
