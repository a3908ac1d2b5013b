"""KV cache: byte layout, quantization (the one place it happens), device and host stores."""
