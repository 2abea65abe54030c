"""Development tools: measurement, modeling and plotting of our own runs, swift-tiny training and the
GPU check. Not part of the installed package; run from the repository root as `python -m tools.NAME`
(README.md)."""
