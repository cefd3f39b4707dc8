"""The K3 language backbone: sequence mixers (KDA, Gated MLA), depth (Block AttnRes), width (LatentMoE)."""
