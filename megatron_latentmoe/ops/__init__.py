"""Tensor ops of Stable LatentMoE (no Megatron imports here): ``situ`` (SPEC §2 SiTU-GLU) and
``mxfp4`` (SPEC §5 routed-expert weights)."""
