"""Gemma 4 (dense and MoE) with model-owned context parallelism."""
