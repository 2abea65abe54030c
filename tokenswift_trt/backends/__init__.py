"""Execution backends for the model: the CPU's compiled decoder and linears, ONNX Runtime, TensorRT."""
