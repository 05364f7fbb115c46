"""Evaluating ONE trained model: the task interface, shared text scoring (lm.py) and the tasks.

    from difftransformer.eval import EvalConfig, run_task
    result = run_task("heldout-loss", model, tokenizer, EvalConfig(data_dir="cache/data/sotu-8192"))
"""

from difftransformer.eval import probes  # registers the white-box probes
from difftransformer.eval.lm import (
    ContinuationScore,
    Generation,
    continuation_logprob,
    encode_prompt,
    generate_text,
    new_token_budget,
    token_nll,
)
from difftransformer.eval.task import (
    TASKS,
    EvalConfig,
    Task,
    TaskNotApplicable,
    TaskResult,
    get_task,
    register_task,
    run_task,
)
from difftransformer.eval.tasks import HeldOutLoss  # registers the built-in tasks

__all__ = [
    "TASKS", "probes", "ContinuationScore", "EvalConfig", "Generation", "HeldOutLoss", "Task", "TaskNotApplicable",
    "TaskResult",
    "continuation_logprob",
    "encode_prompt", "generate_text", "get_task", "new_token_budget", "register_task", "run_task", "token_nll",
]
