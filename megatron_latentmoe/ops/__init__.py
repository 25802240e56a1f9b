"""Elementwise ops of Stable LatentMoE (no Megatron imports here): ``situ`` (SPEC §2) and
``rms_norm`` (SPEC §1 latent norm),
``mxfp4`` (SPEC §5 routed-expert weights)."""
