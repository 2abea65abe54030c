"""tokenswift-trt: lossless TokenSwift decoding for ultra-long generation.

The import package's subpackages live in the repository's top-level folders:
`runtime/` (the decoding algorithm) and `builder/` (checkpoints to engine dirs).
"""

__version__ = "0.1.0"
