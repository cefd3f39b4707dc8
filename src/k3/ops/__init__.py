"""Pure tensor functions (no nn.Module), each with an fp64 reference."""
