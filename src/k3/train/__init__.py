"""Training: tokenizer, data, optimisers (Per-Head Muon), quantile balancing, the loop and checkpoints (SPEC §5, §7)."""
