"""`kvferry serve`: an OpenAI-compatible HTTP server with continuous batching over the engine."""
