"""Retrofit (convert/llama_retrofit.py): a Llama (GQA, odd head count like SmolLM2's 9 / 3) as a
`diff_retrofit` model with the same logits at conversion (fp32 within 1e-5 relative, float64 within
1e-12), and a model that departs from the source once λ or the head-norm ramp moves (so the check can fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from difftransformer.convert import ConversionError, calibrate_head_norm, retrofit_llama  # noqa: E402
from difftransformer.model import DiffTransformerConfig, DiffTransformerLM  # noqa: E402
from tests.convert import VOCAB, ids, logits, randomise_, rel, transformers_in_float64, transformers_model  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# 9 query / 3 kv heads of dim 8 (SmolLM2's shape, scaled down), tied; 4 / 2 heads of dim 16, untied.
CASES = {"9q3kv-tied": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
         "4q2kv-untied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False)}


def llama(case: str, dtype=torch.float32) -> LlamaForCausalLM:
    hf = dict(model_type="llama", vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, hidden_act="silu",
              max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e5, attention_bias=False,
              mlp_bias=False, initializer_range=0.1, **CASES[case])
    return randomise_(transformers_model(LlamaForCausalLM, hf, None, dtype), seed=3)


def ours_from(state, cfg, dtype, backend="sdpa") -> DiffTransformerLM:
    model = DiffTransformerLM(dataclasses.replace(cfg, attn_backend=backend)).to(dtype).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("second_map", ["uniform", "copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_retrofitted_model_has_the_source_logits(case, dtype, second_map, monkeypatch):
    if dtype == torch.float64:
        transformers_in_float64(monkeypatch)
    source = llama(case, dtype)
    state, cfg = retrofit_llama(source.state_dict(), source.config.to_dict(), second_map=second_map)
    assert cfg.attention == "diff_retrofit" and cfg.lambda_init == 0.0
    assert cfg.num_attention_heads == source.config.num_attention_heads  # heads are not halved
    assert cfg.head_dim == source.config.hidden_size // source.config.num_attention_heads
    model = ours_from(state, cfg, dtype)
    assert all(row.value == 0.0 for row in model.lambdas())
    expected = logits(source, ids())
    assert rel(logits(model, ids()), expected) < TOL[dtype]
    assert rel(logits(ours_from(state, cfg, dtype, "eager"), ids()), expected) < TOL[dtype]


def test_moving_lambda_or_the_head_norm_ramp_departs_from_the_source():
    source = llama("9q3kv-tied")
    state, cfg = retrofit_llama(source.state_dict(), source.config.to_dict())
    expected = logits(source, ids())
    model = ours_from(state, cfg, torch.float32)
    with torch.no_grad():
        model.layers[0].self_attn.lambda_q2.mul_(-1.0)  # λ = exp(a) - exp(-a) != 0
    assert model.lambdas()[0].value != 0.0
    assert rel(logits(model, ids()), expected) > 1e-4
    model = ours_from(state, cfg, torch.float32)
    model.layers[1].self_attn.set_head_norm_mix(1.0)
    assert rel(logits(model, ids()), expected) > 1e-4


def test_calibrating_the_head_norm_keeps_the_function_and_softens_the_ramp():
    source = llama("9q3kv-tied")
    state, cfg = retrofit_llama(source.state_dict(), source.config.to_dict())
    expected = logits(source, ids())
    plain, fitted = ours_from(state, cfg, torch.float32), ours_from(state, cfg, torch.float32)
    means = calibrate_head_norm(fitted, torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(9)))
    assert len(means) == 2 and all(0 < m < 1 for m in means)  # a head's output RMS is below 1
    assert rel(logits(fitted, ids()), expected) < TOL[torch.float32]  # α = 0: still the source
    for model in (plain, fitted):
        model.set_training_step(10**6)  # α = 1
    assert rel(logits(fitted, ids()), expected) < rel(logits(plain, ids()), expected)  # (SmolLM2: by 10^5, docs)
    with pytest.raises(ValueError, match="at head-norm mix α = 0"):
        calibrate_head_norm(fitted, ids())


def test_a_tied_head_stored_once_and_a_state_dict_round_trip():
    source = llama("9q3kv-tied")
    sd = dict(source.state_dict())
    del sd["lm_head.weight"]
    state, cfg = retrofit_llama(sd, source.config.to_dict())
    assert state["lm_head.weight"] is state["embed_tokens.weight"]
    assert DiffTransformerConfig.from_dict(cfg.to_dict()) == cfg


def test_the_ramp_follows_the_training_step():
    source = llama("4q2kv-untied")
    state, cfg = retrofit_llama(source.state_dict(), source.config.to_dict(), head_norm_ramp_steps=4)
    model = ours_from(state, cfg, torch.float32)
    for step, alpha in ((0, 0.0), (1, 0.25), (4, 1.0), (9, 1.0)):
        model.set_training_step(step)
        assert all(float(b.self_attn.head_norm_mix) == alpha for b in model.layers)
    assert float(model.state_dict()["layers.0.self_attn.head_norm_mix"]) == 1.0  # saved with the weights
    model.set_training_step(0)  # a new run from a ramped model: α is never lowered
    assert float(model.layers[0].self_attn.head_norm_mix) == 1.0


def test_bad_choices_are_refused():
    source = llama("4q2kv-untied")
    with pytest.raises(ConversionError, match="second_map='zeros'.*uniform, copy"):
        retrofit_llama(source.state_dict(), source.config.to_dict(), second_map="zeros")
    with pytest.raises(ValueError, match="apply to attention='diff_retrofit' only"):
        DiffTransformerConfig(attention="diff", attention_head_dim=8)


def test_the_command_writes_a_folder_with_the_source_logits(tmp_path, capsys):
    from difftransformer.cli import main

    source = llama("9q3kv-tied")
    source.save_pretrained(tmp_path / "llama")
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "out"), "--ramp-steps", "7"]) == 0
    model = DiffTransformerLM.from_pretrained(tmp_path / "out").eval()
    assert model.config.attention == "diff_retrofit" and model.config.head_norm_ramp_steps == 7
    assert rel(logits(model, ids()), logits(source, ids())) < 1e-5
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "out2"), "--check", "16"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("max abs logit difference on 16 random tokens:") and float(line.rsplit(" ", 1)[1]) < 1e-4
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "out")]) == 2  # not overwritten
    # --calibrate fits the head norm on a text file (a word-level tokenizer saved beside the source)
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "llama" / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words[(7 * i) % VOCAB] for i in range(600)))
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "cal"), "--calibrate", str(text)]) == 0
    model = DiffTransformerLM.from_pretrained(tmp_path / "cal").eval()
    assert not torch.equal(model.layers[0].self_attn.subln.weight, torch.ones(2 * cfg_head_dim(model)))
    assert rel(logits(model, ids()), logits(source, ids())) < 1e-5
    assert (tmp_path / "cal" / "tokenizer.json").is_file()


def test_the_retrofitted_folder_keeps_the_sources_tokens_and_generation_settings(tmp_path):
    """What transformers and lm-eval read beside the weights: the source's special-token ids (config.json), its
    tokenizer settings (tokenizer_config.json: the tokenizer class and what it adds to a text), generation
    settings and chat template go into the retrofitted folder, so through AutoModelForCausalLM and AutoTokenizer
    it stops, and encodes, as the source does."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    import difftransformer.hf  # noqa: F401
    from difftransformer.cli import main

    source = llama("9q3kv-tied")
    source.config.update({"bos_token_id": 1, "eos_token_id": 2})
    source.save_pretrained(tmp_path / "llama")
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3]).save_pretrained(tmp_path / "llama")
    words = [f"w{i}" for i in range(VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2").save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert {k: json.loads((out / "config.json").read_text()).get(k) for k in ("bos_token_id", "eos_token_id")} == {
        "bos_token_id": 1, "eos_token_id": 2}
    assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == [2, 3]
    text = "w5 w6 w9"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == AutoTokenizer.from_pretrained(
        tmp_path / "llama")(text)["input_ids"]
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }}"


def cfg_head_dim(model) -> int:
    return model.config.head_dim
