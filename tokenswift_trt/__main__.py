"""`python -m tokenswift_trt` (and `torchrun -m tokenswift_trt`): the `tokenswift-trt` command."""

from tokenswift_trt.cli import main

main()
