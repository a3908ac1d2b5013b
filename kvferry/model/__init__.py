"""Model runtime: architectures, weight loading (GGUF, safetensors), tokenizer, chat template."""
