"""The target model and its draft layers: the Llama/Qwen2 decoder, rotary embeddings, KV caches,
the processed target distribution, engines and engine directories."""
