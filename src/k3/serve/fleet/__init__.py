"""Replicas behind a router (SPEC §8): the launcher and the consistent-hash router; they speak HTTP only."""
