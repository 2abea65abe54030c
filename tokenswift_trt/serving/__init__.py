"""Serving: the Triton request handler, the tritonserver process manager and the client."""
