"""Causal sequence mixers: ``forward(x, state) -> (y, state)`` with an explicit state."""
