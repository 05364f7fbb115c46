"""Arms of a study: the paper's ablation rows by name, their structure and parameter counts, and config errors."""

from __future__ import annotations

import dataclasses

import pytest

from difftransformer.experiments import ABLATIONS, Arm, StudyConfig, parse_arm
from difftransformer.model import DiffTransformerLM, get_preset
from difftransformer.model.kinds import attention_kind


@pytest.fixture(scope="module")
def spec():
    return get_preset("cpu-small").config(vocab_size=512)


def _params(cfg) -> int:
    return DiffTransformerLM(cfg, device="meta").num_parameters()


def test_every_ablation_row_has_the_structure_its_name_promises(spec):
    configs = {name: arm.config(spec) for name, arm in ABLATIONS.items()}
    E, L = spec.hidden_size, spec.num_hidden_layers
    h, d = spec.num_attention_heads, spec.head_dim  # the spec is DIFF: 4 heads of 2 x 32
    assert (h, d) == (4, 32)
    t = configs["transformer"]
    assert (t.attention, t.num_attention_heads, t.head_dim) == ("transformer", 2 * h, d)
    # the Transformer with DIFF's head count: h heads of 2d (Table 6: 8 heads of 256 at 1.4B)
    for name, kind in (("transformer_diff_heads", "transformer"),
                       ("transformer_diff_heads_headnorm", "transformer_headnorm")):
        c = configs[name]
        assert (c.attention, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (kind, h, h, 2 * d)
    assert configs["transformer_headnorm"].num_attention_heads == 2 * h
    assert configs["diff_no_headnorm"].attention == "diff_no_headnorm"
    assert not attention_kind("diff_no_headnorm").head_norm
    assert configs["diff_lambda_0.8"].lambda_init == 0.8 and configs["diff_lambda_0.5"].lambda_init == 0.5
    assert configs["diff"].lambda_init is None  # the depth schedule
    assert configs["diff_v2"].attention == "diff_v2" and configs["diff_v2"].num_attention_heads == 2 * h
    assert configs["transformer_gated"].attention == "transformer_gated"
    for c in configs.values():  # only attention differs: width, depth, FFN, vocabulary are the spec's
        assert (c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size) == (
            E, L, spec.intermediate_size, spec.vocab_size)
    # parameter counts, derived by hand from what each arm adds to the Transformer
    base = _params(t)
    assert _params(configs["transformer_diff_heads"]) == base  # same q/k/v/o shapes, other head split
    assert _params(configs["diff"]) == base + L * (4 * d + 2 * d)  # 4 λ vectors of d, head-norm weight 2d
    assert _params(configs["diff_no_headnorm"]) == base + L * 4 * d
    assert _params(configs["diff_lambda_0.8"]) == _params(configs["diff"])
    assert _params(configs["transformer_headnorm"]) == base + L * d  # a head-norm weight of one head dim
    assert _params(configs["transformer_diff_heads_headnorm"]) == base + L * 2 * d
    assert _params(configs["transformer_gated"]) == base + L * E * 2 * h  # W_g: hidden -> heads


def test_arms_from_names_kinds_and_tables(spec):
    assert parse_arm("diff_lambda_0.8") is ABLATIONS["diff_lambda_0.8"]
    arm = parse_arm("diff_v2")
    assert (arm.name, arm.attention) == ("diff_v2", "diff_v2")
    custom = parse_arm({"name": "diff_l0.3", "attention": "diff", "overrides": {"lambda_init": 0.3}})
    assert custom.config(spec).lambda_init == 0.3 and custom.config(spec).attention == "diff"
    wide = parse_arm({"name": "t_wide", "attention": "transformer", "heads": "diff",
                      "overrides": {"intermediate_size": 512}})
    c = wide.config(spec)
    assert (c.num_attention_heads, c.head_dim, c.intermediate_size) == (4, 64, 512)
    cfg = StudyConfig(arms=["diff", {"name": "diff_l0.3", "attention": "diff", "overrides": {"lambda_init": 0.3}}])
    assert cfg.arm_names == ["diff", "diff_l0.3"]
    assert StudyConfig(**cfg.to_dict()).arms == cfg.arms  # a manifest's record reads back


@pytest.mark.parametrize("entry, message", [
    ("diff_lamda_0.8", "did you mean 'diff_lambda_0.8'"),
    ("nope", "unknown arm 'nope'"),
    ({"name": "x", "attention": "diff", "overrides": {"lamda_init": 0.3}}, "did you mean 'lambda_init'"),
    ({"name": "x", "attention": "diff", "overrides": {"attn_backend": "eager"}}, "size spec's"),
    ({"name": "x", "attention": "diff", "overrides": {"attention": "transformer"}}, "arm's `attention`"),
    ({"name": "x", "attention": "difff"}, "did you mean 'diff'"),
    ({"name": "x"}, "needs `name` and `attention`"),
    ({"name": "x", "attention": "diff", "heads": "double"}, "heads='double'"),
    ({"name": "a/b", "attention": "diff"}, "folder name"),
    ({"name": "x", "attention": "diff", "train": {"max_step": 10}}, "did you mean 'max_steps'"),
    ({"name": "x", "attention": "diff", "train": {"batch_size": 8}}, "every arm shares it"),
    ({"name": "x", "attention": "diff", "train": {"seed": 1}}, "every arm shares it"),
    ({"name": "x", "attention": "diff", "train": 6000}, "train must be a table"),
    (3, "a name"),
])
def test_bad_arms_are_one_line_errors(entry, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("'", "'")):
        parse_arm(entry)


def test_an_override_that_makes_an_invalid_model_names_the_arm(spec):
    arm = Arm("bad", "diff", {"num_attention_heads": 3})
    with pytest.raises(ValueError, match="arm 'bad' is not a valid model at this size"):
        arm.config(spec)
    with pytest.raises(ValueError, match="lists an arm twice"):
        StudyConfig(arms=["diff", {"name": "diff", "attention": "transformer"}])


def test_lambda_init_belongs_to_the_arms_with_a_scalar_lambda(spec):
    """An arm override of lambda_init on a kind without λ is refused naming the arm; a size spec's lambda_init
    sets the DIFF V1 arms and is not carried into the others (where it would be recorded and ignored)."""
    for kind in ("transformer", "transformer_gated", "diff_v2"):
        with pytest.raises(ValueError, match="arm 'x' is not a valid model at this size: model.lambda_init"):
            Arm("x", kind, {"lambda_init": 0.5}).config(spec)
    assert spec.attention == "diff"
    configs = {a: parse_arm(a).config(dataclasses.replace(spec, lambda_init=0.5))
               for a in ("diff", "transformer", "transformer_gated", "diff_v2")}
    assert configs["diff"].lambda_init == 0.5
    assert all(configs[a].lambda_init is None for a in ("transformer", "transformer_gated", "diff_v2"))


def test_an_arm_may_train_on_its_own_recipe_and_only_there():
    from difftransformer.train import TrainConfig

    recipe = TrainConfig(max_steps=2000, lr=1e-3, seq_len=80, batch_size=32)
    arm = parse_arm({"name": "diff_no_headnorm", "attention": "diff_no_headnorm",
                     "train": {"max_steps": 6000, "lr": 5e-4}})
    own = arm.train_config(recipe)
    assert (own.max_steps, own.lr, own.seq_len, own.batch_size) == (6000, 5e-4, 80, 32)
    assert recipe.max_steps == 2000 and parse_arm("diff").train_config(recipe) is recipe
    assert parse_arm(arm.to_dict()) == arm  # a manifest's arm_specs read back
    assert arm.description == ABLATIONS["diff_no_headnorm"].description  # the named arm's, on its own recipe
    assert parse_arm({"name": "diff_no_headnorm", "attention": "diff"}).description == ""  # another arm
    with pytest.raises(ValueError, match="arm 'bad': its train overrides make an invalid recipe"):
        Arm("bad", "diff", train={"max_steps": 0}).train_config(recipe)
