"""Public test helpers: hypothesis strategies for adversarial tensors, property checks for
quantization codecs (ours and users' own), and a multi-process Gloo runner."""
