"""Elementwise ops of Stable LatentMoE (no Megatron imports here): ``situ`` (SPEC §2)."""
