"""tokenswift-trt: lossless TokenSwift decoding for ultra-long generation.

The library's entry points (tokenswift_trt/api.py): `load(...)` a model, `generate(model, prompt,
max_new_tokens, **settings)`, `start_run` / `resume_run` for journaled runs, and
`generate_batch(model, prompts, max_new_tokens, **settings)` for many prompts decoded together
(tokenswift_trt/batch.py).

Subpackages, imports running one way (decode -> model -> kernels):
`decode/` (the algorithm), `model/` (the target model and its draft layers), `backends/` (the model
over the compiled CPU stack, ONNX Runtime, TensorRT), `kernels/` (custom ops and their settings);
`builder/` (checkpoints to engine dirs), `serving/`, `bench/`, `training/`, `cli/` on top.
"""

__version__ = "0.1.0"

_API = ("ApiError", "Model", "Result", "Run", "generate", "load", "resume_run", "start_run")


def __getattr__(name: str):
    """The API's names, imported on first use (so `import tokenswift_trt` stays light)."""
    if name in _API:
        from tokenswift_trt import api

        return getattr(api, name)
    if name == "generate_batch":
        from tokenswift_trt.batch import generate_batch

        return generate_batch
    raise AttributeError(f"module 'tokenswift_trt' has no attribute {name!r}")
