"""Model configs and presets: the paper's sizes, matched DIFF/Transformer pairs, round trips and errors."""

import pytest

from difftransformer import ATTENTION_KINDS, DiffTransformerConfig, DiffTransformerLM, get_preset
from difftransformer.model.config import PRESETS
from tests.helpers import tiny


@pytest.mark.parametrize("name,target", [("830M", 830e6), ("1.4B", 1.4e9), ("2.8B", 2.8e9), ("6.8B", 6.8e9),
                                         ("13.1B", 13.1e9)])
def test_paper_preset_parameter_counts_within_one_percent(name, target):
    cfg = get_preset(name).config()
    assert cfg.vocab_size == 100_288
    n = DiffTransformerLM(cfg, device="meta").num_parameters(count_embedding_once=True)
    assert abs(n - target) / target < 0.01, n


def test_paper_3b_configuration():
    cfg = get_preset("3B").config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim,
            cfg.intermediate_size) == (3072, 28, 12, 128, 8192)
    assert cfg.matched("transformer").num_attention_heads == 24


@pytest.mark.parametrize("name", ["830M", "1.4B", "2.8B", "6.8B", "13.1B"])
def test_paper_head_dims(name):
    want = {"830M": 96, "1.4B": 128, "2.8B": 128, "6.8B": 128, "13.1B": 128}[name]
    diff, base = get_preset(name).config("diff"), get_preset(name).config("transformer")
    assert diff.head_dim == base.head_dim == want
    assert base.num_attention_heads == 2 * diff.num_attention_heads


@pytest.mark.parametrize("preset", ["tiny", "cpu-small", "cpu-small-h8", "cpu-medium-h8", "1.4B"])
@pytest.mark.parametrize("kv", [None, 2])
def test_matched_models_differ_by_6d_per_layer(preset, kv):
    p = get_preset(preset)
    cfg = p.config("diff", num_key_value_heads=kv) if kv else p.config("diff")
    diff = DiffTransformerLM(cfg, device="meta").num_parameters()
    base_cfg = cfg.matched("transformer")
    base = DiffTransformerLM(base_cfg, device="meta").num_parameters()
    assert diff - base == 6 * cfg.head_dim * cfg.num_hidden_layers
    assert base_cfg.matched("diff") == cfg


def test_config_round_trip_and_unknown_keys(tmp_path):
    cfg = tiny(num_key_value_heads=1, lambda_init=0.8)
    cfg.save(tmp_path / "c.json")
    assert DiffTransformerConfig.load(tmp_path / "c.json") == cfg
    data = cfg.to_dict() | {"num_heads": 3}
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['num_heads'\]"):
        DiffTransformerConfig.from_dict(data)
    for not_an_object in ("[]", "3", '"diff"', "null"):
        (tmp_path / "odd.json").write_text(not_an_object)
        with pytest.raises(ValueError, match="a model config is a JSON object of settings"):
            DiffTransformerConfig.load(tmp_path / "odd.json")


def test_config_errors():
    with pytest.raises(ValueError, match="unknown attention kind"):
        DiffTransformerConfig(attention="softmax2")
    with pytest.raises(ValueError, match="divisible by 2 \\* num_attention_heads"):
        DiffTransformerConfig(hidden_size=100, num_attention_heads=4)
    with pytest.raises(ValueError, match="divisible by num_key_value_heads"):
        DiffTransformerConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="attn_deterministic must be true or false"):
        DiffTransformerConfig(attn_deterministic="no")
    with pytest.raises(KeyError, match="unknown preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match="must be even"):
        DiffTransformerConfig(num_attention_heads=3, hidden_size=96, attention="transformer").matched("diff")


def test_every_preset_builds():
    for name, p in PRESETS.items():
        for kind in ATTENTION_KINDS:
            cfg = p.config(kind)
            assert cfg.attention == kind, name


def test_gpu_unaligned_dims_names_widths_that_are_not_multiples_of_8():
    """By hand: 8/3 x 1024 = 2730.67 rounds to 2731 (odd); gpu-small sets 2752 = 43 x 64; cpu-small's
    8/3 x 256 = 682.67 rounds to 683; a vocabulary of 50257 (GPT-2's) is odd too."""
    from difftransformer import get_preset

    assert get_preset("gpu-small").config("diff").gpu_unaligned_dims() == {}
    assert get_preset("gpu-small").config("diff", intermediate_size=None).gpu_unaligned_dims() == {
        "intermediate_size": 2731}
    assert get_preset("cpu-small").config("diff", vocab_size=50257).gpu_unaligned_dims() == {
        "intermediate_size": 683, "vocab_size": 50257}


def test_gpu_aligned_dims_are_multiples_of_64_the_config_accepts():
    """By hand: hidden 100 with 5 DIFF heads splits into 10 components, which must be even-width: a multiple of
    lcm(64, 20) = 320 -> 320 (head_dim 32; a plain 128 would not split by 10); hidden 110 with 5 baseline
    heads (width 22): lcm(64, 10) = 320 too. FFN 683 -> 704."""
    diff = DiffTransformerConfig(hidden_size=100, num_attention_heads=5, intermediate_size=683, vocab_size=8192)
    assert diff.gpu_aligned_dims() == {"hidden_size": 320, "intermediate_size": 704}
    base = DiffTransformerConfig(hidden_size=110, num_attention_heads=5, attention="transformer", intermediate_size=704)
    assert base.gpu_aligned_dims() == {"hidden_size": 320}
    for cfg, name in ((diff, "diff"), (base, "transformer")):
        fixed = DiffTransformerConfig(hidden_size=cfg.gpu_aligned_dims()["hidden_size"], num_attention_heads=5,
                                      attention=name)
        assert "hidden_size" not in fixed.gpu_unaligned_dims()  # and it constructed: a valid config


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_position_encoding_is_checked_and_flows_through_matched(kind):
    nope = get_preset("tiny").config(kind, position_encoding="none")
    assert nope.position_encoding == "none" and tiny(kind).position_encoding == "rope"
    for other in ATTENTION_KINDS:
        assert nope.matched(other).position_encoding == "none"
    assert DiffTransformerConfig.from_dict(nope.to_dict()) == nope
    with pytest.raises(ValueError, match="model.position_encoding must be 'rope' .* or 'none' .*, got 'NoPE'"):
        tiny(kind, position_encoding="NoPE")
    with pytest.raises(TypeError, match="model.position_encoding must be a str, got None .*: quote a string, --set "
                                        "'model.position_encoding=\"none\"'$"):
        tiny(kind, position_encoding=None)  # what `--set model.position_encoding=none` gives: null


@pytest.mark.parametrize("attention", ["transformer", "transformer_gated", "diff_v2", "transformer_headnorm"])
def test_lambda_init_is_refused_where_it_would_do_nothing(attention):
    """Only the DIFF V1 kinds have a scalar λ: elsewhere lambda_init would be recorded and ignored."""
    with pytest.raises(ValueError, match=rf"model.lambda_init \(0.5\) applies to .*attention='{attention}' has none"):
        tiny(attention, lambda_init=0.5)
    for kind in ("diff", "diff_no_headnorm"):
        assert tiny(kind, lambda_init=0.5).lambda_init == 0.5
    assert tiny("diff", lambda_init=0.5).matched("diff_no_headnorm").lambda_init == 0.5
