"""Nemotron-H / Nemotron V3 hybrid Mamba2 + attention + MoE models with multi-token prediction."""
