"""The policy model: loading (a directory, the hub, GGUF, or the embedded model),
LoRA adapters, and the tiny random models of the tests and examples."""
