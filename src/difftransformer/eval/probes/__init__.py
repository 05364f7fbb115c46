"""White-box probes: evaluation tasks that look inside attention (the only part of eval/ that may).

They run on this package's models only, through the explicit entry points in `hooks.py`.
Importing this package registers them with `difftransformer.eval.task`."""

from difftransformer.eval.probes.attention_noise import AttentionNoise
from difftransformer.eval.probes.hooks import (
    attention_layers,
    capture_layer_outputs,
    inspect_attention,
    require_own_model,
)
from difftransformer.eval.probes.logit_quant import LogitQuant, fake_quantize
from difftransformer.eval.probes.ood import OOD
from difftransformer.eval.probes.outliers import Outliers

__all__ = ["AttentionNoise", "LogitQuant", "OOD", "Outliers", "attention_layers", "capture_layer_outputs",
           "fake_quantize", "inspect_attention", "require_own_model"]
