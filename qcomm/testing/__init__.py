"""Public test helpers: hypothesis strategies for adversarial tensors, property checks for
quantization codecs (ours and users' own), a multi-process Gloo runner, and a launcher that
counts how processes exit after a distributed run."""
