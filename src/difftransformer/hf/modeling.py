"""`DiffTransformerForCausalLM`: our `DiffTransformerLM` as a Hugging Face `PreTrainedModel` + `GenerationMixin`.

Contract:
- The modules are our own: the constructor builds a `DiffTransformerLM` and adopts its children
  (embed_tokens, layers, norm, lm_head), so the attention math, the blocks, the initialisation and
  the weight tying are the package's, and the state-dict keys are exactly ours, with no prefix. A
  folder written by `DiffTransformerLM.save_pretrained` therefore loads with
  `AutoModelForCausalLM.from_pretrained(dir)`, and the weights `save_pretrained` writes here load
  strictly in `DiffTransformerLM` (the config.json it writes carries transformers' own keys too:
  read it with `DiffTransformerHFConfig.from_pretrained(dir).to_native()`). `from_native(lm)` wraps
  an existing model and `native()` returns one; both share the parameters, they never copy them.
- Loading is as strict as ours: safetensors only (a pickle is never opened, use_safetensors=False is
  refused), and a file missing weights of the config's model, or holding others, is refused in
  one line instead of being completed at random.
- `forward` only runs the blocks in order (embedding -> blocks -> final norm -> LM head, the loop of
  `DiffTransformerLM.forward`), adding what transformers needs around it: its KV cache, key-padding
  masks with positions that skip left padding, hidden states, attention maps and checkpointing.
- KV cache: a transformers `Cache` (a `DynamicCache` by default; `forward` takes it as `cache`, its name
  from transformers 5.24, or as `past_key_values`, its name before), seen by our layers through
  `_CacheAdapter`, which gives them the `update(depth, k, v)` and `length(depth)` of our `KVCache`.
  DIFF caches keys (B, 2*h_kv, S, d) and values (B, h_kv, S, 2d); a cache that grows by concatenation
  holds them, caches preallocated from the config (StaticCache, cache_implementation="static") cannot,
  and are refused.
- attention_mask is a (batch, cached + new tokens) key mask, 1 for tokens and 0 for padding, as our
  layers take it; without position_ids, positions count only real tokens (left padding), as
  `DiffTransformerLM.generate` does. An all-ones mask is dropped so the fast kernels stay usable.
- output_attentions returns each layer's differential map A1 - lambda*A2 (the map itself for
  ordinary attention), (B, heads, T, S), computed on the eager backend for that call.
- Training: labels are unshifted (transformers' convention), -100 ignored; the loss is transformers'
  `loss_function`, given forward's other keywords as its causal LMs give them (num_items_in_batch,
  ignore_index, shift_labels); gradient checkpointing (`gradient_checkpointing_enable()`) checkpoints each block.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging

import difftransformer.hf.compat as compat
from difftransformer.hf.compat import CACHE_KEY
from difftransformer.hf.configuration import DiffTransformerHFConfig
from difftransformer.hf.generation import graph_decoder_for, lean_sample, lean_sample_applies, sample_arguments
from difftransformer.model import ATTENTION_KINDS, DiffTransformerLM
from difftransformer.model.inputs import check_input_ids, keep_last_positions, last_rows_kept, positions_from_mask
from difftransformer.model.modeling import raise_head_norm_mix
from difftransformer.model.serialization import CONFIG_NAME, WEIGHTS_NAME
from difftransformer.norm import RMSNorm

log = logging.get_logger(__name__)
_DIFF_HEADS = frozenset(name for name, kind in ATTENTION_KINDS.items() if kind.diff_heads)  # V1's cache layout


_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(CausalLMOutputWithPast))


@dataclasses.dataclass
class DiffTransformerCausalLMOutput(CausalLMOutputWithPast):
    """transformers' `CausalLMOutputWithPast` (same fields, same attribute, dict and tuple views: an instance of
    it), only built faster. ModelOutput's construction looks the dataclass fields up again for each field it
    sets and once more to check them (~10 µs per output, ~30 µs inside a 5 M model's decoding step, where the
    interpreter's data is out of the CPU caches); here the field names are known once, and a field that is not
    None becomes a key as ModelOutput makes it one. ModelOutput's other forms, a dict or an iterator of
    (key, value) pairs as the only argument (accelerate's `send_to_device` / `convert_to_fp32` and
    `nn.DataParallel`'s gather rebuild outputs so), go through ModelOutput's own construction."""

    def __post_init__(self) -> None:
        # Keyword construction: every field was set, and keyed, by __setattr__ below, as ModelOutput's own
        # __setattr__ would have. A first field that is not a tensor may be ModelOutput's dict / pairs form:
        # its own check sorts that out from the same state.
        if self.loss is not None and not isinstance(self.loss, torch.Tensor):
            super().__post_init__()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _OUTPUT_FIELDS:  # another name (an old name of a field, say): ModelOutput's own rules
            super().__setattr__(name, value)
            return
        if value is not None:
            collections.OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)


def _output(**fields: Any) -> CausalLMOutputWithPast:
    """forward's output: the fast class where its ModelOutput internals were tested (compat.FAST), else
    transformers' own class."""
    return (DiffTransformerCausalLMOutput if compat.FAST else CausalLMOutputWithPast)(**fields)


class _InPlaceLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers written in place, grown by doubling,
    instead of a torch.cat of the whole cache at every step (what transformers' own layer does).

    Whatever transformers does to `keys` / `values` between steps (beam search reordering, crop,
    repeat_interleave) leaves either a view of the same buffers (crop) or a new tensor; the next
    update sees which and, for a new tensor, copies it into fresh buffers. New keys and values must
    have the cached ones' batch, heads and dim (where DynamicLayer's torch.cat would fail, a write in
    place would broadcast a size-1 batch without a word; refused instead). Under autograd it behaves
    exactly like `DynamicLayer` (in-place writes into a graph would be wrong)."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None
    _returned: tuple | None = None  # the (keys, values) views the last update returned

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self._kbuf = self._vbuf = self._returned = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values, returned = self.keys, self.values, self._returned
        n = keys.shape[-2] if keys.numel() else 0
        if n and not (_same_sizes(keys, key_states) and _same_sizes(values, value_states)):
            raise ValueError(f"the cache holds keys {tuple(keys.shape)} and values {tuple(values.shape)}; the new "
                             f"ones are {tuple(key_states.shape)} and {tuple(value_states.shape)}: batch, heads and "
                             f"dim must match. A cache belongs to the batch that filled it; use a new one per batch")
        total = n + key_states.shape[-2]
        kbuf, vbuf = self._kbuf, self._vbuf
        untouched = returned is not None and returned[0] is keys and returned[1] is values  # our views, as returned
        views = untouched or (n and kbuf is not None and keys.data_ptr() == kbuf.data_ptr()
                              and values.data_ptr() == vbuf.data_ptr())
        # the buffers' sizes against the new rows' (after an empty first update nothing above compared them)
        if not (views and total <= kbuf.shape[-2] and _same_sizes(kbuf, key_states)
                and _same_sizes(vbuf, value_states)):
            kbuf = self._kbuf = _grown(keys, n, key_states, total)
            vbuf = self._vbuf = _grown(values, n, value_states, total)
        kbuf[:, :, n:total] = key_states
        vbuf[:, :, n:total] = value_states
        self.keys, self.values = kbuf[:, :, :total], vbuf[:, :, :total]
        self._returned = (self.keys, self.values)
        return self.keys, self.values


def _same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (B, heads, S, dim) tensors agree in batch, heads and dim (the lengths may differ)."""
    sa, sb = a.shape, b.shape
    return sa[0] == sb[0] and sa[1] == sb[1] and sa[3] == sb[3]


def _grown(current: torch.Tensor, n: int, new: torch.Tensor, total: int) -> torch.Tensor:
    """A buffer for at least `total` positions (doubling), holding the `n` cached ones first."""
    buf = new.new_empty(new.shape[0], new.shape[1], max(2 * total, 64), new.shape[3])
    if n:
        buf[:, :, :n] = current
    return buf


class _CacheAdapter:
    """A transformers `Cache` seen as our `KVCache`: `update(depth, k, v)` -> all (k, v), `length(depth)`,
    `constants`. Made for one forward call; what it keeps lives on the cache.

    A plain `DynamicCache` (what generate() makes) gets `_InPlaceLayer`s for its empty layers, so
    decoding writes in place as our own cache does, with the transformers releases that was tested with
    (compat.FAST); any other cache, and any cache with other releases, is used as it is. For an
    `_InPlaceLayer` the adapter reads the length and calls `update` on the layer itself, which is all
    `DynamicCache` does for a layer that is not offloaded, without its generic checks (an ABC
    isinstance per call): ~20 µs per layer of a small model's decoding step."""

    def __init__(self, cache: Cache):
        self.cache = cache
        held = cache.__dict__
        if not held.get("_difftransformer_in_place") and compat.FAST:
            _in_place(cache)
        # the layer list itself (DynamicCache appends to it), when the cache was converted
        self._layers = held.get("layers") if held.get("_difftransformer_in_place") else None
        # `KVCache.constants`, kept on the transformers cache
        self.constants: dict[int, tuple] = held.setdefault("_difftransformer_constants", {})

    def _own_layer(self, layer: int) -> _InPlaceLayer | None:
        """The cache's layer `layer` if it is one of ours in a cache `_in_place` converted, else None."""
        layers = self._layers
        if layers is None or layer >= len(layers):
            return None
        own = layers[layer]
        return own if type(own) is _InPlaceLayer else None

    def length(self, layer: int = 0) -> int:
        own = self._own_layer(layer)
        if own is None:
            return self.cache.get_seq_length(layer)
        return own.keys.shape[-2] if own.is_initialized and own.keys.numel() else 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        own = self._own_layer(layer)
        return own.update(k, v) if own is not None else self.cache.update(k, v, layer)


def _in_place(cache: Cache) -> None:
    """Once per cache: a plain DynamicCache's empty DynamicLayers become _InPlaceLayers, and so do the
    layers it adds later; other caches (offloaded, static, subclasses) are left as they are."""
    layers = getattr(cache, "layers", None)
    if type(cache) is not DynamicCache or layers is None or getattr(cache, "offloading", False):
        return
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = _InPlaceLayer
    for i, existing in enumerate(layers):
        if type(existing) is DynamicLayer and not existing.is_initialized:
            layers[i] = _InPlaceLayer()
    cache._difftransformer_in_place = True


class DiffTransformerForCausalLM(PreTrainedModel, GenerationMixin):
    """See the module docstring. Registered with AutoModelForCausalLM by `import difftransformer.hf`."""

    config_class = DiffTransformerHFConfig
    base_model_prefix = ""  # the state dict is the LM's own, keys unprefixed
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderBlock"]
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache's name up to 5.23, and from 5.24
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}  # a tied key and its source
    _supports_static_cache = False

    def __init__(self, config: DiffTransformerHFConfig):
        super().__init__(config)
        for name, module in DiffTransformerLM(config.to_native()).named_children():
            self.add_module(name, module)
        self.gradient_checkpointing = False
        self.post_init()

    # diff_retrofit's head-norm ramp: whether a training forward should still say that no one raises it
    _ramp_unset = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "DiffTransformerForCausalLM":
        """transformers' `from_pretrained`, made as strict as `DiffTransformerLM.from_pretrained`: safetensors
        only (a pickle is never loaded, whatever its name), and every weight of the model in the file and
        nothing else (transformers alone would initialise missing weights at random and only log it).
        An unreadable or mismatched weights file is a one-line ValueError naming it.

        A training run's folder loads its final/ model (every CLI command takes run folders; through
        AutoModelForCausalLM, which reads the folder's config.json first, give subfolder="final"). A folder's
        tokenizer.json (a run's final/ holds the one the model was trained with) gives the config and the
        generation config the EOS id where they name none, as BOS, EOS and pad (what the model was trained
        with before every document), so generate() stops at EOS as transformers' models do."""
        if kwargs.get("use_safetensors") is False:
            raise ValueError("use_safetensors=False asks to unpickle weights; difftransformer loads safetensors only "
                             "(a pickle can run code when loaded). Convert the checkpoint to safetensors")
        wants_info = kwargs.pop("output_loading_info", False)
        kwargs.update(use_safetensors=True, output_loading_info=True)
        subfolder = kwargs.get("subfolder") or ""
        if not subfolder:
            pretrained_model_name_or_path = _final_of_run(pretrained_model_name_or_path)
        source = str(pretrained_model_name_or_path)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        except SafetensorError as e:
            raise ValueError(f"{WEIGHTS_NAME} of {source!r} is not a readable safetensors file ({e}); it may be "
                             f"truncated or corrupted, or another format renamed (a pickle is never loaded)") from None
        except RuntimeError as e:  # transformers refuses tensors of the wrong shape with a RuntimeError
            if "mismatch" not in str(e):
                raise
            lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
            _refuse(source, lines[0] if lines else "tensor shapes differ; see transformers' load report above")
        _check_loaded(source, info)
        _adopt_tokenizer_eos(model, Path(str(pretrained_model_name_or_path)) / subfolder)
        return (model, info) if wants_info else model

    # -- generation ---------------------------------------------------------------------
    def _prepare_position_ids_for_generation(self, *args, **kwargs):
        """None with the tested transformers releases (compat.FAST): transformers would make position_ids from
        the mask and extend them every step, but `forward` derives the same positions from the mask itself, and
        without padding (no mask, no position_ids) its layers read RoPE from the table every layer shares instead
        of computing the angles per layer and token (~15% of a small model's decoding step). Other releases:
        transformers' own method (a private one, whose contract may change)."""
        if compat.FAST:
            return None
        return super()._prepare_position_ids_for_generation(*args, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """The inputs of one generation step: what transformers' generic method gives a decoder-only model
        whose cache is never preallocated (ours refuses those), without its work for other models; with
        transformers releases this was not tested with (compat.FAST False), the generic method itself.

        That is: the last `next_sequence_length` tokens (all of them when None; `inputs_embeds` instead on the
        first step when given), the cache (under compat.CACHE_KEY), the 2-D attention mask, position_ids only when
        the caller gave generate() some (sliced to the step; see _prepare_position_ids_for_generation), every other
        keyword except labels, all on the model's device. The generic method, built for every architecture, also
        branches for encoder-decoders, compiled caches, token types and multimodal inputs, and copies the ids; it
        cost ~20-30 µs of each ~2.6 ms decoding step of a 5 M model. Two differences that change nothing here:
        token-type ids are passed whole (forward ignores them) and the ids are a view, not a contiguous copy (the
        embedding takes any strides). As transformers does, the tensors move to the model's device when the step's
        input is on another.
        """
        if not compat.FAST:
            return super().prepare_inputs_for_generation(
                input_ids, next_sequence_length=next_sequence_length, attention_mask=attention_mask,
                inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)
        last = slice(None) if next_sequence_length is None else slice(-next_sequence_length, None)
        if inputs_embeds is not None and is_first_iteration:
            step = inputs_embeds[:, last]
            inputs = {"input_ids": None, "inputs_embeds": step}
        else:
            step = input_ids[:, last]
            inputs = {"input_ids": step}
        if (cache := kwargs.pop(CACHE_KEY, None)) is not None:
            inputs[CACHE_KEY] = cache
        if (position_ids := kwargs.pop("position_ids", None)) is not None:
            inputs["position_ids"] = position_ids[..., -step.shape[1]:]
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        for key, value in kwargs.items():
            if key not in inputs and key not in ("labels", "next_sequence_length"):
                inputs[key] = value
        weight = self.embed_tokens.weight  # as transformers: the step's tensors move when its input is elsewhere
        if not (step.is_cpu and weight.is_cpu) and weight.device.type != "meta" and step.device != weight.device:
            inputs = {k: v.to(weight.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        return inputs

    def _sample(self, *args, **kwargs):
        """transformers' greedy search and multinomial sampling; with the releases it was tested with
        (compat.FAST), the plain calls (`generation.lean_sample_applies`: token ids, length and EOS stops, any
        processors, no streamer or returned scores) run the same loop without its per-step overhead
        (`generation.lean_sample`: the same tokens, ~0.1 ms less per token); on CUDA, where a graph can run, its
        forward passes are a static KV cache's steps replayed from a CUDA graph (`generation.graph_decoder_for`).
        Every other call, and every call with other releases, is handed to transformers' `_sample` as it came."""
        if compat.FAST:
            input_ids, processors, criteria, config, synced_gpus, streamer, model_kwargs = sample_arguments(
                *args, **kwargs)
            if lean_sample_applies(self, config, synced_gpus, streamer, criteria, model_kwargs):
                decoder = graph_decoder_for(self, input_ids, criteria.max_length, model_kwargs)
                return lean_sample(self, input_ids, processors, criteria, config, model_kwargs, decoder)
        return super()._sample(*args, **kwargs)

    # -- the native model, both ways (shared parameters) ----------------------------------
    @classmethod
    def from_native(cls, lm: DiffTransformerLM, **config_kwargs: Any) -> "DiffTransformerForCausalLM":
        """Wrap `lm` without copying: the returned model uses lm's modules (training one trains both).

        config_kwargs: Hugging Face settings for the config (eos_token_id, pad_token_id, ...)."""
        config = DiffTransformerHFConfig.from_native(lm.config, **config_kwargs)
        with torch.device("meta"):  # placeholders, replaced at once by lm's modules
            model = cls(config)
        for name, module in lm.named_children():
            setattr(model, name, module)
        return model.train(lm.training)

    def native(self) -> DiffTransformerLM:
        """A `DiffTransformerLM` on these very modules (for `lambdas()`, our `generate`, our `save_pretrained`)."""
        lm = DiffTransformerLM(self.config.to_native(), device="meta")
        for name, module in self.named_children():
            setattr(lm, name, module)
        return lm.train(self.training)

    def set_training_step(self, step: int) -> None:
        """diff_retrofit's head-norm ramp before optimizer step `step`, as our trainer sets it
        (`DiffTransformerLM.set_training_step`; a no-op for other kinds). transformers' Trainer does not call
        it: give it `difftransformer.hf.HeadNormRampCallback()`; a loop of one's own calls this before each step."""
        raise_head_norm_mix(self.layers, self._native_config, step)
        self._ramp_unset = False

    @functools.cached_property
    def _native_config(self):
        return self.config.to_native()

    def _warn_if_ramp_unset(self) -> None:
        """Once, in a training forward of a diff_retrofit model whose head-norm ramp nobody raises."""
        cfg = self._native_config
        if not (cfg.kind.head_norm_ramp and cfg.head_norm_ramp_steps):
            self._ramp_unset = False
            return
        if all(float(block.self_attn.head_norm_mix) >= 1 for block in self.layers):
            self._ramp_unset = False  # already ramped in: nothing left to raise
            return
        log.warning(f"this diff_retrofit model blends its head norm in over head_norm_ramp_steps="
                    f"{self.config.head_norm_ramp_steps} optimizer steps, but nothing raises the blend as it trains: "
                    f"with transformers' Trainer pass callbacks=[difftransformer.hf.HeadNormRampCallback()], in a "
                    f"loop of your own call model.set_training_step(step) before each optimizer step")
        self._ramp_unset = False

    # -- what transformers asks of a model -------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def _init_weights(self, module: nn.Module) -> None:
        """Our initialisation (DiffTransformerLM.reset_parameters), module by module as transformers asks:
        linear and embedding weights N(0, initializer_range), norms 1, λ vectors N(0, 0.1), SSMax scales
        1 / log(ssmax_init_length)."""
        if hasattr(module, "reset_ssmax_parameters"):
            module.reset_ssmax_parameters()
        if hasattr(module, "reset_lambda_parameters"):
            module.reset_lambda_parameters()
        elif isinstance(module, RMSNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache_position: torch.LongTensor | None = None,  # our cache knows its length; accepted, not needed
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """Logits (B, T, vocab) of input_ids (or inputs_embeds) after the cached tokens; see the module docstring.

        The cache is `cache` or `past_key_values` (its names from transformers 5.24 and up to 5.23; give one);
        the output holds it under the installed transformers' name (compat.CACHE_KEY)."""
        cfg = self.config
        if self._ramp_unset and self.training and torch.is_grad_enabled():
            self._warn_if_ramp_unset()
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = cfg.return_dict if return_dict is None else return_dict
        x = self._embed(input_ids, inputs_embeds)
        B, T = x.shape[:2]
        past_key_values = self._transformers_cache(_one_cache(cache, past_key_values), self._use_cache(use_cache))
        cache = None if past_key_values is None else _CacheAdapter(past_key_values)
        past = 0 if cache is None else cache.length(0)
        self._check_length(past + T)
        mask = _key_mask(attention_mask, B, past + T)  # None without padding: the default positions, fast paths
        if position_ids is None and mask is not None:
            position_ids = positions_from_mask(mask)[:, -T:]
        if output_attentions:
            with self._maps_backend():
                x, hidden, maps = self._blocks(x, mask, position_ids, cache, True, output_hidden_states)
        else:  # the last block computes only the kept positions' rows, unless every hidden state is asked for
            last_rows = 0 if output_hidden_states else last_rows_kept(logits_to_keep)
            x, hidden, maps = self._blocks(x, mask, position_ids, cache, False, output_hidden_states, last_rows)
        if output_hidden_states:  # transformers' last hidden state is the normed one, at every position
            x = self.norm(x)
            hidden = (*hidden, x)
            logits = self.lm_head(keep_last_positions(x, logits_to_keep))
        else:  # the norm is per position: only the kept ones need it
            logits = self.lm_head(self.norm(keep_last_positions(x, logits_to_keep)))
        loss = None
        if labels is not None:
            # the keywords go to the loss as transformers' causal LMs pass them (num_items_in_batch, ignore_index,
            # shift_labels: what its Trainer gives under gradient accumulation and context parallelism)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=cfg.vocab_size, **kwargs)
        out = _output(loss=loss, logits=logits, hidden_states=hidden, attentions=maps, **{CACHE_KEY: past_key_values})
        return out if return_dict else out.to_tuple()

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is not None:
            E = self.config.hidden_size
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != E:
                raise ValueError(f"inputs_embeds must be (batch, seq_len, {E}); got {tuple(inputs_embeds.shape)}")
            return inputs_embeds
        check_input_ids(input_ids, self.config.vocab_size)
        return self.embed_tokens(input_ids)

    def _use_cache(self, use_cache: bool | None) -> bool:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training:
            log.warning_once("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            return False
        return bool(use_cache)

    def _transformers_cache(self, past_key_values, use_cache: bool) -> Cache | None:
        """The transformers cache this call reads and extends (a new DynamicCache when asked for none)."""
        if type(past_key_values) is DynamicCache:  # what generate() passes at every step: nothing to check
            return past_key_values
        if past_key_values is None:
            return DynamicCache() if use_cache else None
        if not isinstance(past_key_values, Cache):
            raise TypeError(f"the cache (past_key_values) must be a transformers Cache (DynamicCache), got "
                            f"{type(past_key_values).__name__}; legacy tuples are not supported: pass "
                            f"DynamicCache() or let generate() make one")
        if getattr(past_key_values, "is_compileable", False):
            why = ("differential attention caches keys (B, 2*h_kv, S, d) and values (B, h_kv, S, 2d), which it "
                   "cannot hold" if self.config.attention in _DIFF_HEADS else "the wrapper takes growing caches only")
            raise ValueError(f"the cache is a {type(past_key_values).__name__}, preallocated from the config's head "
                             f"counts; {why}. Use DynamicCache (the default; no cache_implementation='static': on "
                             f"CUDA, generate() already decodes on a static cache of its own, from a CUDA graph)")
        return past_key_values

    def _checkpoint_func(self):
        """transformers' checkpoint function (the attribute `gradient_checkpointing_enable` sets on the model, with
        the caller's options), else torch's own non-reentrant checkpoint."""
        func = getattr(self, "_gradient_checkpointing_func", None)
        return func if func is not None else functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def _check_length(self, total: int) -> None:
        limit = self.config.max_position_embeddings
        if total > limit:
            raise ValueError(f"sequence length {total} (cached + new tokens) exceeds max_position_embeddings "
                             f"{limit}; truncate the input or use a config with a longer context")

    @contextlib.contextmanager
    def _maps_backend(self):
        """Run the attention layers on the eager backend (the one that materialises maps), for output_attentions."""
        layers = [block.self_attn for block in self.layers]
        saved = [layer.backend for layer in layers]
        try:
            for layer in layers:
                layer.backend = "eager"
            yield
        finally:
            for layer, backend in zip(layers, saved):
                layer.backend = backend

    def _blocks(self, x, mask, position_ids, cache, output_attentions: bool, output_hidden_states: bool,
                last_rows: int = 0):
        """The decoder blocks in order, before the final norm; (x, hidden states or None, maps or None).

        Hidden states follow transformers: the embedding output and each block's input after it; the caller
        adds the final one after the norm (num_hidden_layers + 1 tensors in all). last_rows n > 0: the last block
        outputs the last n positions only (the model's `outputs_to_keep`; every key and value still cached)."""
        hidden, maps = [], []
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.layers):
            if output_hidden_states:
                hidden.append(x)
            kwargs = dict(attention_mask=mask, position_ids=position_ids, kv_cache=cache,
                          return_attention=output_attentions,
                          outputs_to_keep=last_rows if i == len(self.layers) - 1 else 0)
            if checkpointing:
                res = self._checkpoint_func()(functools.partial(block.__call__, **kwargs), x)
            else:
                res = block(x, **kwargs)
            if output_attentions:
                x, layer_maps = res
                maps.append(layer_maps.diff)
            else:
                x = res
        return x, tuple(hidden) if output_hidden_states else None, tuple(maps) if output_attentions else None


def _final_of_run(path):
    """A local training run's folder as its final/ folder; anything else as given. A run folder is told by its
    layout, not its names (those are train/run_dir.py's, which hf may not import): no config.json of its own,
    and exactly one subfolder holding a model (config.json and weights), its final/ (checkpoints, and a
    replaced run's final/, sit one level deeper)."""
    folder = Path(str(path))
    if not folder.is_dir() or (folder / CONFIG_NAME).is_file():
        return path
    models = [sub for sub in folder.iterdir() if (sub / CONFIG_NAME).is_file() and (sub / WEIGHTS_NAME).is_file()]
    return models[0] if len(models) == 1 else path


def _adopt_tokenizer_eos(model: "DiffTransformerForCausalLM", path) -> None:
    """BOS, EOS and pad ids from the tokenizer.json of a local model folder, where neither the config nor the
    generation config names them (an explicit setting, from config.json or a generation_config.json, stays)."""
    from difftransformer.data.tokenizer import TOKENIZER_FILE, Tokenizer

    tokenizer = Path(str(path)) / TOKENIZER_FILE
    if not tokenizer.is_file() or model.config.eos_token_id is not None:
        return
    try:
        eos = Tokenizer.from_file(tokenizer).eos_id
    except (OSError, ValueError):  # not our tokenizer (no EOS token): the model loads all the same, without one
        return
    for config in (model.config, model.generation_config):
        if config is None:
            continue
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(config, name, None) is None:
                setattr(config, name, eos)


def _one_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The cache given under either of its names (transformers 5.24 calls it `cache`, 5.23 `past_key_values`)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("both cache and past_key_values were given, two different caches; pass one (`cache` from "
                         "transformers 5.24, `past_key_values` before)")
    return past_key_values if cache is None else cache


def _check_loaded(source: str, info: dict[str, Any]) -> None:
    """Refuse a load that left weights at random or ignored some: the file is not this config's model."""
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {k.replace("_keys", ""): v for k, v in problems.items() if v}
    if problems:
        _refuse(source, "; ".join(f"{k}: {', '.join(map(str, v[:3]))}"
                                  f"{f' (and {len(v) - 3} more)' if len(v) > 3 else ''}" for k, v in problems.items()))


def _refuse(source: str, detail: str) -> None:
    raise ValueError(f"the weights of {source!r} do not match the model its config describes ({detail}); was the "
                     f"config edited, or copied from another model?") from None


def _key_mask(attention_mask: torch.Tensor | None, B: int, S: int) -> torch.Tensor | None:
    """The (B, S) boolean key mask our layers take, from transformers' 2-D attention_mask; None for no mask
    or one without padding (then the layers use their fast paths and the default positions)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, S):
        raise ValueError(f"attention_mask must be the 2-D (batch, cached + new tokens) = ({B}, {S}) padding mask, "
                         f"1 for tokens and 0 for padding; got shape {tuple(attention_mask.shape)}. 4-D masks "
                         f"(custom attention patterns) are not supported: attention here is causal with key padding")
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask
