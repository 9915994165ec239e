"""Running compiled kernels: packing for them, loading them (the runtime), their calls, compiling ahead."""
