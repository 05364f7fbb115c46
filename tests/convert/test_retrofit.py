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
from tests.convert import (  # noqa: E402
    VOCAB,
    ids,
    logits,
    randomise_,
    rel,
    same_tensors,
    transformers_in_float64,
    transformers_model,
)

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


def _write_gguf(path, source: LlamaForCausalLM, tokenizer) -> None:
    """`source` and its byte-level BPE as an F32 .gguf file, laid out as llama.cpp's converter writes a Llama: its
    tensor names, and the q and k rows of each head permuted into its RoPE layout (transformers undoes that)."""
    import json

    import gguf
    import numpy as np

    cfg = source.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    def rope_layout(w: np.ndarray, heads: int) -> np.ndarray:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}" for ours, theirs in parts.items()})
    state = source.state_dict()
    for name, theirs in names.items():
        w = state[name].numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = rope_layout(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = rope_layout(w, cfg.num_key_value_heads)
        writer.add_tensor(f"{theirs}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_retrofits_as_its_transformers_folder_does(tmp_path, capsys):
    """A .gguf file (read through transformers and `gguf`) gives the same model, bit for bit, as the same Llama's
    transformers folder, with the source's logits, its special-token ids and generation settings, and its
    tokenizer (encoding as the source's)."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM

    from difftransformer.cli import main

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["the cat sat on the mat, and the dog sat on the log. " * 4], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(), intermediate_size=96, num_hidden_layers=2,
              hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e5, attention_bias=False,
              mlp_bias=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2, **CASES["9q3kv-tied"])
    source = randomise_(transformers_model(LlamaForCausalLM, hf), seed=3)
    source.save_pretrained(tmp_path / "llama")
    _write_gguf(tmp_path / "tiny.gguf", source, tokenizer)

    assert main(["retrofit", str(tmp_path / "tiny.gguf"), str(tmp_path / "from-gguf"), "--check", "16"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("max abs logit difference on 16 random tokens:") and float(line.rsplit(" ", 1)[1]) < 1e-4
    assert main(["retrofit", str(tmp_path / "llama"), str(tmp_path / "from-folder")]) == 0
    assert same_tensors(*(load_file(tmp_path / name / "model.safetensors") for name in ("from-gguf", "from-folder")))
    out = tmp_path / "from-gguf"
    model = DiffTransformerLM.from_pretrained(out).eval()
    assert rel(logits(model, ids()), logits(source, ids())) < 1e-5
    import difftransformer.hf  # noqa: F401  (registers the auto classes)

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id, loaded.generation_config.eos_token_id) == (1, 2, 2)
    text = "the dog sat on the cat"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == tokenizer.encode(text).ids


def test_a_gguf_file_without_the_gguf_package_is_refused_naming_it(tmp_path, monkeypatch):
    import importlib.util

    from difftransformer.hf.load import load_llama_model

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r"m.gguf is a GGUF file; reading it needs the gguf package: pip install "
                                         r"'difftransformer\[gguf\]'"):
        load_llama_model(tmp_path / "m.gguf")
