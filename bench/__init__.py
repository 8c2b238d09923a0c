"""qcomm's benchmarks: kernel and gossip micro-benchmarks, and the emulated cluster (cluster/)."""
