// The Python module of the CPU kernels: one extension, so one compile and one load.
#include "kernels_cpu.h"

#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor type caster (lighter than torch/extension.h)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("tree_attention", &tree_attention_cpu, "tree attention over a float32 KV cache (CPU)");
    module.def("gumbel_topk", &gumbel_topk_cpu,
               "penalty, temperature and min-p over float32 logits, then the best tokens of scores + noise (CPU)");
}
