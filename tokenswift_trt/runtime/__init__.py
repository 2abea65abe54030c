"""The TokenSwift decoding runtime: model, caches, drafting, verification, sampling."""
