"""The CUDA device layer: everything that exists only to make training fast on an NVIDIA GPU
(decoding from a bf16 copy of the weights in a fixed-shape loop that CUDA graphs replay),
behind one seam the backends own (grpo.backends.device_layer); nothing else imports it."""
