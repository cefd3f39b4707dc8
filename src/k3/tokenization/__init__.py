"""Tokenizers of released checkpoints (the tiktoken-based Kimi tokenizer)."""
