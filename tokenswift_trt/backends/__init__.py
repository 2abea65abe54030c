"""Execution backends around the model: ONNX Runtime and TensorRT, and the loader that picks one."""
