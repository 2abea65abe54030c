"""tokenswift-trt: lossless TokenSwift decoding for ultra-long generation.

Subpackages, imports running one way (decode -> model -> kernels):
`decode/` (the algorithm), `model/` (the target model and its draft layers), `backends/` (the model
over the compiled CPU stack, ONNX Runtime, TensorRT), `kernels/` (custom ops and their settings);
`builder/` (checkpoints to engine dirs), `serving/`, `bench/`, `training/`, `cli/` on top.
"""

__version__ = "0.1.0"
