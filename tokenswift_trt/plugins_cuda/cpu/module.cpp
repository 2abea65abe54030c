// The Python module of the CPU kernels: one extension, so one compile and one load.
#include "kernels_cpu.h"

#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor type caster (lighter than torch/extension.h)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
    module.def("tree_attention", &tree_attention_cpu, "tree attention over a float32 KV cache (CPU)");
    module.def("gumbel_topk", &gumbel_topk_cpu,
               "penalty, temperature and min-p over float32 logits, then the best tokens of scores + noise (CPU)");
    module.def("pack_linear", &pack_linear_cpu,
               "a float32 weight [out, in] in the small-batch linear's layout (huge_pages: on 2 MB pages)",
               pybind11::arg("weight"), pybind11::arg("huge_pages") = true);
    module.def("pack_linear_half", &pack_linear_half_cpu,
               "the same layout in float16, widened to float32 as the product loads it",
               pybind11::arg("weight"), pybind11::arg("huge_pages") = true);
    module.def("zeros_on_huge_pages", &zeros_on_huge_pages_cpu,
               "zeros on 2 MB pages where the OS grants them (weights and caches streamed at every step)");
    module.def("linear", &linear_cpu, "x[M, in] times a packed weight, batch-invariant (CPU, float32)");
    module.def("screened_logits", &screened_logits_cpu,
               "an LM head exact where sampling can look, screened in float16 elsewhere (CPU, float32)");
    module.def("draft_chain", &draft_chain_cpu, "the draft layers' chain for a few rows in one call (CPU, float32)");
    module.def("decoder", &decoder_cpu, "the decoder stack for a few new tokens in one call (CPU, float32)");
    module.def("decoder_batch", &decoder_batch_cpu,
               "the decoder stack for several requests' new tokens, each on its own cache (CPU, float32)");
}
