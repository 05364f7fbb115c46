"""Which transformers the wrapper's fast paths were tested with, and the name of the cache argument.

Contract:
- `TESTED_MINORS`: the transformers releases (major.minor) whose private internals the wrapper's fast
  paths were tested against; `FAST` says whether the installed one is. The fast paths: the lean
  generation loop (generation.lean_sample, run by an override of GenerationMixin's private `_sample`
  for plain calls), the lean step inputs (`prepare_inputs_for_generation`, the generic method's work
  for this model only), no position_ids from generate() (an override of the private
  `_prepare_position_ids_for_generation`), generate()'s cache written in place (modeling._InPlaceLayer,
  a subclass of `DynamicLayer` put into a `DynamicCache`'s layer list) and the output built without
  ModelOutput's per-field lookups (modeling.DiffTransformerCausalLMOutput). With any other release
  (`FAST` False) the wrapper runs transformers' own path for each (GenerationMixin's loop and step
  inputs, its DynamicLayer, CausalLMOutputWithPast): slower, never other tokens. tests/hf holds each
  fast path to the public one it replaces whatever the installed version, so the day a release changes
  an internal, those tests fail, and the release is added here only once they pass.
- `CACHE_KEY`: the name under which this transformers passes the cache between generate() and the
  model, read from its public output class `CausalLMOutputWithPast`: "past_key_values" up to 5.23,
  "cache" from 5.24 (which still accepts the old name, with a deprecation warning, in its own models).
  The wrapper's forward accepts both names and returns the cache under CACHE_KEY.
"""

from __future__ import annotations

import dataclasses

import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

TESTED_MINORS = ("5.23", "5.24")

CACHE_KEY = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


def minor(version: str) -> str:
    """'5.24.0' -> '5.24' (a dev or rc suffix stays on the patch part)."""
    return ".".join(version.split(".")[:2])


def tested(version: str | None = None) -> bool:
    """Whether transformers `version` (default: the installed one) is a release the fast paths were tested with."""
    return minor(transformers.__version__ if version is None else version) in TESTED_MINORS


# Whether the wrapper takes its fast paths: read at each call (tests set it to run either path on any release).
FAST = tested()
