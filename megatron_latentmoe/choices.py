"""Allowed values of the Stable LatentMoE options, importable without Megatron (the CLI validates
flags with them before anything heavy is imported)."""

QUANTILE_HISTOGRAM = "quantile_histogram"
"""``moe_router_load_balancing_type`` value that selects our QB router (SPEC §4)."""

HIDDEN_ACTS = ("situ", "swiglu")
"""``hidden_act``: SiTU-GLU (SPEC §2) or plain SwiGLU (ablations)."""

QB_BINNINGS = ("uniform", "centered")
"""``moe_qb_binning``: SPEC §4's uniform bins, or bins centred on each expert's bias."""
