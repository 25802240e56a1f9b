"""Elementwise ops of Stable LatentMoE (no Megatron imports here): ``situ`` (SPEC §2) and
``rms_norm`` (SPEC §1 latent norm)."""
