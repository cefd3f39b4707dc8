"""kimi-k3: the Kimi K3 model, training recipe and serving stack in PyTorch."""
