"""Sequence sharding and ring attention for context parallelism."""
