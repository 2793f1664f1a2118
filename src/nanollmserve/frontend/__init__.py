"""The frontend: text in, text out. Tokenizes and applies chat templates, detokenizes
incrementally, applies stop strings, fans `n > 1` out into child requests, and (AsyncEngine)
feeds per-request output queues from one engine loop."""
