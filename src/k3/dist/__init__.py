"""Scale-out on ``torch.distributed`` (SPEC §8): context parallelism so far (`k3.dist.context`)."""
