"""Black-box evaluation tasks: they see a model's logits only (through eval/lm.py). Importing this
package registers them with `difftransformer.eval.task`."""

from difftransformer.eval.tasks.hallucination import Hallucination
from difftransformer.eval.tasks.heldout_loss import HeldOutLoss
from difftransformer.eval.tasks.icl import ICL
from difftransformer.eval.tasks.long_context import LongContext
from difftransformer.eval.tasks.needle import Needle

__all__ = ["Hallucination", "HeldOutLoss", "ICL", "LongContext", "Needle"]
