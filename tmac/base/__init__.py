"""The foundation: errors, file and CPU facts, the format table, quantized weights, the numpy reference, memory."""
