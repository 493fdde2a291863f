"""The quantization math, schemes, recipes and the weight-parallel plan (pure, no I/O)."""
