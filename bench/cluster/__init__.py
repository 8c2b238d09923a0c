"""The emulated-cluster benchmark: methods, workloads, the rank's script and the sweep driver."""
