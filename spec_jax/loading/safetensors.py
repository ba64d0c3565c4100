"""HF safetensors checkpoints of Qwen3.5 / Qwen3.6 / Qwen3-Next (float, FP8 or NVFP4) into the
NNX model; the name mapping is `source`'s."""

from __future__ import annotations

import dataclasses
import logging
import os

from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from spec_jax.loading.quantized import QuantizedSource, read_quant_scheme
from spec_jax.loading.source import TensorSource, fill_params, is_stacked, param_sources, read_tensor

log = logging.getLogger("spec_jax")


def load_params(model_dir: str | os.PathLike, cfg: Qwen3_5Config, dtype, *, progress: bool | None = None,
                placement=None):
    """Load a Qwen3.5/3.6/Next checkpoint into a `Qwen3_5Model`.

    dtype: compute dtype of the weights (norm weights, A_log and dt_bias stay float32).
    placement: where each parameter goes as it is read (`fill_params`'s; None: the default device).
    Returns (model, cfg); cfg loses its MTP head when the checkpoint has no `mtp.*` tensors.
    FP8 and NVFP4 checkpoints keep their quantized projections quantized (`loading.quantized`).
    """
    scheme = read_quant_scheme(model_dir)
    src = TensorSource(model_dir) if scheme is None else QuantizedSource(model_dir, scheme)
    if cfg.mtp_num_hidden_layers and "mtp.fc.weight" not in src:
        # A checkpoint exported without its MTP head still runs; speculation with mtp refuses it.
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    elif not cfg.mtp_num_hidden_layers and "mtp.fc.weight" in src:
        # config.json without mtp_num_hidden_layers: the head's tensors say how many layers it has.
        layers = {name.split(".")[2] for name in src.names() if name.startswith("mtp.layers.")}
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=len(layers))
    make_model = lambda: Qwen3_5Model(cfg, dtype=dtype)  # noqa: E731
    if scheme is not None:
        make_model = src.keep_quantized(make_model, cfg)
    model = fill_params(make_model, src,
                        lambda path: (param_sources(path, cfg), is_stacked(path)),
                        lambda name: read_tensor(src, name, cfg), progress=progress, placement=placement)
    unread = src.unread()
    if unread:
        log.warning("%s: %d tensors of the checkpoint are not used by the model config.json describes (%s%s); "
                    "check num_hidden_layers, layer_types and the tensor names", model_dir, len(unread),
                    ", ".join(unread[:3]), ", ..." if len(unread) > 3 else "")
    return model, cfg
