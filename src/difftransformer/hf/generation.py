"""transformers' greedy and sampling loop for `DiffTransformerForCausalLM`, without its per-step overhead.

Why: `GenerationMixin._sample` serves every model and every option of `generate` (streamers, multi-GPU
sync, returned scores, compiled forwards, assistants, any stopping criterion), and pays for that at each
step: it copies the step's logits, calls the processor list even when it is empty, builds two tensors to
ask the stopping criteria and reads a flag back from them. In a 5 M model's 2.5 ms decoding step that was
~0.1 ms, most of what kept the wrapper's `generate` over 5% slower than the native one.

`lean_sample` is that loop for the calls `generate()` makes most: greedy search or multinomial sampling
with any logits processors, stopped by `max_length` / `max_new_tokens` and the EOS ids, on the
DynamicCache that generate() creates. It runs transformers' own steps in transformers' order (its
prefill, the model's `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation`, the
processors, the EOS criterion, padding finished rows with the pad id), so it gives the same tokens, and
the same samples from the same seed (tests compare the two); it only leaves out what such a call does not
need: the logits copy when no processor could write into them, the stopping-criteria list for the
length (a host-side count) and the read-back when no EOS id can stop a row. Two warnings of transformers'
loop are not given here, neither of which can concern these calls: the length criterion's reminder that
the text has passed max_position_embeddings (this model refuses such a step with an error instead) and
the notice that a `compile_config` cannot compile the forward (no compiled forward exists for a
DynamicCache, which is the only cache admitted). Any other call (`lean_sample_applies` is False) runs
transformers' loop, and so does every call with a transformers release the loop was not tested with
(compat.FAST, checked by the caller).
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from difftransformer.hf.compat import CACHE_KEY
from difftransformer.model.static_decode import StaticDecoder, capacity_for, decoder_for, graph_unsupported

log = logging.getLogger(__name__)

# The step inputs generate() passes a decoder-only model on token ids (anything else: transformers' loop).
_PLAIN_MODEL_KWARGS = frozenset({"attention_mask", "logits_to_keep", CACHE_KEY, "position_ids", "use_cache"})


# What lean_sample uses of transformers' generation internals (5.x): where one is missing (another version), the
# call runs transformers' own loop instead of failing.
_INTERNALS = ("_prefill", "_optimize_model_for_decode", "_update_model_kwargs_for_generation")
_CONFIG_FIELDS = ("_pad_token_tensor", "is_assistant", "prefill_chunk_size", "return_dict_in_generate", "do_sample")


def sample_arguments(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus: bool = False,
                     streamer=None, **model_kwargs) -> tuple:
    """The arguments of a `GenerationMixin._sample` call (its signature in the tested releases) as a tuple:
    (input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs)."""
    return input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs


def lean_sample_applies(model, generation_config, synced_gpus: bool, streamer, stopping_criteria,
                        model_kwargs: dict) -> bool:
    """Whether `lean_sample` runs this `_sample` call: no multi-GPU sync, no streamer, no returned dict (scores,
    caches), no assistant, no chunked prefill, token ids (not embeddings) with only the plain step inputs, the
    DynamicCache generate() made, stopping criteria that are one length limit and EOS ids only, and the
    generation internals it uses where it expects them."""
    if not (all(hasattr(model, name) for name in _INTERNALS)
            and all(hasattr(generation_config, name) for name in _CONFIG_FIELDS)):
        return False
    return (not synced_gpus and streamer is None and not generation_config.return_dict_in_generate
            and not generation_config.is_assistant and generation_config.prefill_chunk_size is None
            and type(model_kwargs.get(CACHE_KEY)) is DynamicCache and model_kwargs.get("use_cache") is True
            and model_kwargs.keys() <= _PLAIN_MODEL_KWARGS
            and sum(type(c) is MaxLengthCriteria for c in stopping_criteria) == 1  # its max_length is the limit
            and all(type(c) is MaxLengthCriteria or type(c) is EosTokenCriteria for c in stopping_criteria))


def lean_sample(model, input_ids: torch.Tensor, logits_processor, stopping_criteria, generation_config,
                model_kwargs: dict, decoder: StaticDecoder | None = None) -> torch.Tensor:
    """transformers' `_sample` loop for a call `lean_sample_applies` to; returns the (B, T + n) token ids.

    decoder: None runs the forward passes as transformers does (its prefill, then one model call per step on
    its cache); a `StaticDecoder` (from `graph_decoder_for`) runs them on a static KV cache, each step replayed
    from a CUDA graph: the same logits up to rounding, chosen and stopped by the same code below."""
    eos = [c for c in stopping_criteria if type(c) is EosTokenCriteria]
    max_length = stopping_criteria.max_length
    pad = generation_config._pad_token_tensor
    if pad is not None:
        pad = pad.to(input_ids.device)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    do_sample, processors = generation_config.do_sample, len(logits_processor) > 0
    steps = (_transformers_steps(model, input_ids, generation_config, model_kwargs) if decoder is None
             else _static_steps(decoder, input_ids, model_kwargs.get("attention_mask")))
    try:
        logits = next(steps)
        while True:
            if processors:  # a processor may write into its input: give it a copy, as transformers does
                scores = logits_processor(input_ids, logits.to(copy=True, dtype=torch.float32, device=input_ids.device))
            else:
                scores = logits.to(dtype=torch.float32, device=input_ids.device)
            if do_sample:
                next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            if eos:  # finished rows emit the pad id
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if input_ids.shape[1] >= max_length:
                break
            if eos:
                for criterion in eos:
                    unfinished = unfinished & ~criterion(input_ids, None)
                if unfinished.max() == 0:
                    break
            logits = steps.send(input_ids)
    finally:
        steps.close()
    return input_ids


def _transformers_steps(model, input_ids, generation_config, model_kwargs):
    """The last position's logits of transformers' prefill, then of one step per `send(input_ids)`."""
    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    with model._optimize_model_for_decode():
        while True:
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            logits = outputs.logits[:, -1]
            del outputs
            input_ids = yield logits
            model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)


def static_refusal(model, max_length: int, model_kwargs: dict) -> str | None:
    """Why a `StaticDecoder` would not compute this generate() call, or None when it does. The decoder starts
    from an empty cache, at the positions the attention mask gives the prompt, and holds at most
    max_position_embeddings positions; so a call with position_ids of its own, one that continues a cache already
    holding tokens, and one whose max_length passes the model's limit (whose step past the limit must fail with
    the model's own error) run transformers' steps instead."""
    if model_kwargs.get("position_ids") is not None:
        return "the call gives position_ids of its own"
    cache = model_kwargs.get(CACHE_KEY)
    if cache is not None and cache.get_seq_length() > 0:
        return "the call continues a cache that already holds tokens"
    if max_length > model.config.max_position_embeddings:
        return f"max_length {max_length} passes max_position_embeddings {model.config.max_position_embeddings}"
    return None


def _static_steps(decoder: StaticDecoder, input_ids, attention_mask):
    """The same logits from a `StaticDecoder`: its prefill of the prompt, then a step per `send(input_ids)`."""
    input_ids = yield decoder.start(input_ids, attention_mask)
    while True:
        input_ids = yield decoder.step(input_ids[:, -1])


def graph_decoder_for(model, input_ids: torch.Tensor, max_length: int, model_kwargs: dict) -> StaticDecoder | None:
    """A CUDA-graph `StaticDecoder` for this call of the wrapper `model` (on the native model sharing its
    modules), or None where it would not compute this call (`static_refusal`) or a graph cannot run (not CUDA, a
    score hook, a trace: `graph_unsupported`)."""
    if (why := static_refusal(model, max_length, model_kwargs)) is not None:
        log.debug("generate() decodes on transformers' steps, not a static cache: %s", why)
        return None
    if graph_unsupported(model, input_ids.device) is not None:
        return None
    capacity = capacity_for(max_length, model.config.max_position_embeddings)
    return decoder_for(model, input_ids.shape[0], capacity, input_ids.device, graph=True, runner=model.native)
