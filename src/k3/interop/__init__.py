"""Converters between peer model families and K3."""
