"""How Megatron's training loop builds a Stable LatentMoE model.

Megatron-Core 0.19.2's ``pretrain`` builds the model from ``cfg_container.model``: a
``GPTModelConfig`` whose ``builder`` names a ``ModelBuilder``. Ours is the same config type with
our ``StableLatentMoETransformerConfig`` inside (as ``transformer``) and a builder whose
``build_model`` calls :func:`megatron_latentmoe.model.build_gpt_model` (see model.py).

The builder also installs the step-end hook on the model's config (Megatron's ``train()`` keeps
a builder-installed ``finalize_model_grads_func``): gradient finalisation, the Quantile
Balancing bias update, and balance logging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig
from megatron.training.vocab_utils import calculate_padded_vocab_size

from megatron_latentmoe.cli_errors import FlagError
from megatron_latentmoe.config import StableLatentMoETransformerConfig
from megatron_latentmoe.fields import ConfigError
from megatron_latentmoe.model import build_gpt_model
from megatron_latentmoe.moe.checkpoint_names import LEGACY_NORM_NAME
from megatron_latentmoe.moe.layer import use_legacy_names_of
from megatron_latentmoe.training.arguments import BACKENDS, flag_message
from megatron_latentmoe.training.megatron_refusals import megatron_config_refusal

_FINALIZE_HOOK = None  # set by install_finalize_hook (pretrain.main) before the model is built


def install_finalize_hook(hook) -> None:
    """The ``finalize_model_grads_func`` every model built from now on gets on its config."""
    global _FINALIZE_HOOK
    _FINALIZE_HOOK = hook


def _default_finalize_hook():
    from megatron_latentmoe.training.balance_logging import make_finalize_model_grads_func

    return make_finalize_model_grads_func(None)


@dataclass(kw_only=True)
class StableLatentMoEModelConfig(GPTModelConfig):
    """``GPTModelConfig`` for Stable LatentMoE: ``transformer`` is a
    ``StableLatentMoETransformerConfig``."""

    builder: ClassVar[str] = (
        "megatron_latentmoe.training.model_provider.StableLatentMoEModelBuilder"
    )
    latentmoe_backend: str = "local"
    """Layer-spec backend of ``build_gpt_model``: ``local`` or ``te``."""


class StableLatentMoEModelBuilder(GPTModelBuilder):
    """Builds each pipeline stage with :func:`megatron_latentmoe.model.build_gpt_model`."""

    def build_model(
        self,
        pg_collection: ProcessGroupCollection,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ):
        cfg = self._model_config
        transformer = cfg.transformer
        if cfg.vocab_size is None:
            raise ValueError("vocab_size must be set before building the model")
        vocab = cfg.vocab_size
        if cfg.should_pad_vocab:
            vocab = calculate_padded_vocab_size(
                vocab, cfg.make_vocab_size_divisible_by, transformer.tensor_model_parallel_size
            )
        vp_size = transformer.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = is_vp_first_stage(
                vp_stage=vp_stage, vp_size=vp_size
            ) and is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_vp_last_stage(
                vp_stage=vp_stage, vp_size=vp_size
            ) and is_pp_last_stage(pg_collection.pp)
        if transformer.finalize_model_grads_func is None:
            transformer.finalize_model_grads_func = _FINALIZE_HOOK or _default_finalize_hook()
        model = build_gpt_model(
            transformer,
            vocab_size=vocab,
            max_sequence_length=cfg.seq_length,
            backend=cfg.latentmoe_backend,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
            rotary_base=cfg.rotary_base,
            vp_stage=vp_stage,
            pg_collection=pg_collection,
        )
        if use_legacy_names_of(model, _resume_checkpoint_keys()):
            from megatron.training.utils import print_rank_0

            print_rank_0(
                "[model_provider] the checkpoint to load names the latent norm "
                f"'{LEGACY_NORM_NAME}' (before the rename): loading and saving under that name"
            )
        return model


def _resume_checkpoint_keys() -> list[str]:
    """Tensor keys of the ``torch_dist`` checkpoint this training run will load ([] if none):
    the one :mod:`.resume` says Megatron loads (``--load`` or ``--pretrained-checkpoint``, a
    newer non-persistent one, ``--ckpt-step``'s)."""
    try:
        from megatron.training import get_args

        args = get_args()
    except (ImportError, AssertionError):  # built outside megatron.training
        return []
    from megatron_latentmoe.training.resume import resumed_by_args

    if getattr(args, "ckpt_format", None) != "torch_dist":
        return []
    path = resumed_by_args(args)
    if path is None or not os.path.isfile(os.path.join(path, ".metadata")):
        return []
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def transformer_config_from_args(args) -> StableLatentMoETransformerConfig:
    """``StableLatentMoETransformerConfig`` from Megatron's args (after ``validate_args``).

    Megatron's own translation (``core_transformer_config_from_args``) fills every
    ``TransformerConfig`` field with the same name in ``args``; our added fields carry the same
    names as their flags' dests. A wrong value raises :class:`FlagError` naming the flag.
    """
    from megatron.training.argument_utils import core_transformer_config_from_args

    try:
        config = core_transformer_config_from_args(
            args, config_class=StableLatentMoETransformerConfig
        )
    except ConfigError as err:
        raise FlagError(flag_message(err)) from None
    except (ValueError, AssertionError) as err:  # Megatron's own TransformerConfig checks
        raise FlagError(megatron_config_refusal(args, err)) from None
    if not isinstance(
        config, StableLatentMoETransformerConfig
    ):  # Megatron swapped the class (MLA, ...)
        raise FlagError(
            f"these flags select Megatron's {type(config).__name__}, which Stable LatentMoE "
            "does not support (remove --multi-latent-attention / heterogeneous layers)"
        )
    return config


def model_config_from_args(
    args, transformer: StableLatentMoETransformerConfig
) -> StableLatentMoEModelConfig:
    """The ``cfg_container.model`` for ``pretrain`` (needs the tokenizer: run after
    ``set_global_variables``, which sets ``args.padded_vocab_size``)."""
    from megatron.training.argument_utils import gpt_config_from_args

    model_cfg = gpt_config_from_args(
        args, config=transformer, model_config_cls=StableLatentMoEModelConfig
    )
    model_cfg.latentmoe_backend = BACKENDS[args.transformer_impl]
    return model_cfg
