"""llama-bench-style benchmark, link probe and plots."""
