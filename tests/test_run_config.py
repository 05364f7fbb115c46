"""Run configs: TOML and YAML agree, --set overrides, head counts in the kind's units, errors that name the key."""

from pathlib import Path

import pytest

from difftransformer.run_config import ConfigError, apply_overrides, load_run_config, parse_scalar


def test_toml_and_yaml_configs_agree(tmp_path):
    (tmp_path / "a.toml").write_text('[model]\npreset = "tiny"\nattention = "transformer"\nhidden_size = 128\n'
                                     '[train]\nlr = 3e-4\nseq_len = 64\n[data]\nvocab_size = 512\n'
                                     '[compare]\narms = ["transformer", "diff"]\n')
    (tmp_path / "a.yaml").write_text("model: {preset: tiny, attention: transformer, hidden_size: 128}\n"
                                     "train: {lr: 3e-4, seq_len: 64}\ndata: {vocab_size: 512}\n"
                                     "compare: {arms: [transformer, diff]}\n")
    a, b = load_run_config(tmp_path / "a.toml"), load_run_config(tmp_path / "a.yaml")
    assert a.to_dict() == b.to_dict()
    assert a.model.attention == "transformer" and a.model.num_attention_heads == 4  # tiny: 2 DIFF heads = 4
    assert a.model.intermediate_size == round(8 * 128 / 3)  # a changed width re-derives the FFN
    assert a.train.lr == 3e-4 and a.train.data_dir == "cache/data/sotu-512"


def test_set_overrides_parse_scalars_and_win_over_the_file(tmp_path):
    (tmp_path / "c.toml").write_text('[model]\npreset = "tiny"\n[train]\nlr = 1e-3\n')
    cfg = load_run_config(tmp_path / "c.toml", attention="transformer",
                          overrides=["train.lr=3e-4", "train.max_steps=7", "train.tensorboard=false",
                                     "model.num_hidden_layers=3", "data.corpus=notes/", 'compare.arms=["diff"]',
                                     "model.rope_theta=5e5", "model.num_key_value_heads=null"])
    assert cfg.train.lr == 3e-4 and cfg.train.max_steps == 7 and cfg.train.tensorboard is False
    assert cfg.model.attention == "transformer" and cfg.model.num_hidden_layers == 3
    assert cfg.model.rope_theta == 5e5  # (lambda_init, DIFF's, is refused on a transformer: tests/model)
    assert cfg.data.corpus == "notes/" and cfg.compare.arm_names == ["diff"]
    assert parse_scalar("[1, 2]") == [1, 2] and parse_scalar("none") is None and parse_scalar("abc") == "abc"


def test_preset_flag_and_head_counts_in_the_kinds_units():
    cfg = load_run_config(preset="cpu-small", attention="transformer", overrides=["model.num_attention_heads=4"])
    assert cfg.model.num_attention_heads == 4 and cfg.model.num_key_value_heads == 4 and cfg.model.head_dim == 64


def test_unknown_key_names_it_and_suggests(tmp_path):
    (tmp_path / "bad.toml").write_text('[model]\npreset = "tiny"\n[train]\nlearning_rat = 1e-3\n')
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "bad.toml")
    msg = str(e.value)
    assert "learning_rat" in msg and "[train]" in msg and "valid keys" in msg and "warmup_steps" in msg
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        load_run_config(overrides=["model.hiden_size=8"])
    with pytest.raises(ConfigError, match="did you mean 'vocab_size'"):
        load_run_config(overrides=["data.vocab_sise=8"])


def test_unknown_section_and_bare_set_key(tmp_path):
    (tmp_path / "s.yaml").write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trian\].*did you mean 'train'"):
        load_run_config(tmp_path / "s.yaml")
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        apply_overrides({"model": {}, "train": {}, "data": {}, "compare": {}}, ["lr=1"])


def test_unknown_preset_lists_presets(tmp_path):
    (tmp_path / "p.toml").write_text('[model]\npreset = "cpu-smal"\n')
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "p.toml")
    assert "cpu-smal" in str(e.value) and "cpu-small" in str(e.value) and "tiny" in str(e.value)


def test_seq_len_above_the_model_limit_names_both():
    with pytest.raises(ConfigError) as e:
        load_run_config(preset="tiny", overrides=["train.seq_len=1024"])
    assert "1024" in str(e.value) and "max_position_embeddings" in str(e.value) and "256" in str(e.value)
    # one check, TrainConfig.check_model, which train() runs too: the same words on either path
    assert "train.seq_len 1024 exceeds the model's max_position_embeddings 256" in str(e.value)


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="unknown arm 'transfomer'.*did you mean 'transformer'"):
        load_run_config(preset="tiny", overrides=['compare.arms=["diff", "transfomer"]'])
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_run_config(preset="tiny", overrides=["train.lr_schedule=wavy"])


def test_each_section_is_built_and_validated_by_its_owner():
    from difftransformer.data import DataConfig
    from difftransformer.experiments import StudyConfig
    from difftransformer.model import DiffTransformerConfig
    from difftransformer.train import TrainConfig

    cfg = load_run_config(preset="tiny", overrides=["data.split_seed=3", "compare.sample_seed=5"])
    assert (type(cfg.model), type(cfg.train), type(cfg.data), type(cfg.compare)) == \
        (DiffTransformerConfig, TrainConfig, DataConfig, StudyConfig)
    assert cfg.data.split_seed == 3 and cfg.compare.sample_seed == 5 and cfg.train.seed == 0
    assert cfg.train.data_dir == "cache/data/sotu-8192-val0.05-test0.05-splitseed3"
    with pytest.raises(ConfigError, match=r"invalid \[data\] settings: data.split_seed must be an integer >= 0"):
        load_run_config(preset="tiny", overrides=["data.split_seed=-2"])


def test_a_renamed_key_names_its_new_name(tmp_path):
    (tmp_path / "old.toml").write_text('[data]\nseed = 1\n')
    with pytest.raises(ConfigError, match=r"\[data\] seed was renamed split_seed; write data.split_seed instead"):
        load_run_config(tmp_path / "old.toml")


def test_vocab_is_sized_from_the_data_unless_set():
    cfg = load_run_config(preset="tiny")
    cfg.resolve_vocab(300)
    assert cfg.model.vocab_size == 300
    fixed = load_run_config(preset="tiny", overrides=["model.vocab_size=256"])
    with pytest.raises(ConfigError,
                       match=r"model.vocab_size \(256\) is smaller than the tokenizer's vocabulary \(300\)"):
        fixed.resolve_vocab(300)


@pytest.mark.parametrize("override, needle", [
    ('compare.seeds=["a"]', "compare.seeds must be a list of integers"),
    ("compare.seeds=[1, 1]", "lists a seed twice"),
    ('compare.prompts="one prompt"', "compare.prompts must be a list of strings"),
    ("compare.sample_tokens=0", "sample_tokens must be a positive integer"),
    ("compare.temperature=-1", "temperature must be a number >= 0"),
    ("compare.top_k=0", "top_k must be a positive integer or null"),
    ("data.val_fraction=1.5", "val_fraction must be a number in \\[0, 1\\)"),
    ("data.test_fraction=0.6", "must be < 1 to leave a train split"),
])
def test_study_and_data_settings_are_checked_before_anything_runs(override, needle):
    overrides = [override] + (["data.val_fraction=0.5"] if "test_fraction" in override else [])
    with pytest.raises(ConfigError, match=needle):
        load_run_config(preset="tiny", overrides=overrides)


def test_a_corpus_setting_beside_a_task_is_refused(tmp_path):
    """[data.task] generates every sequence with its own tokenizer: a corpus, vocabulary or split beside it would be
    silently unused."""
    task = ["data.task.family='flipflop'"]
    for extra, key in (("data.corpus='notes/'", "corpus"), ("data.vocab_size=300", "vocab_size"),
                       ("data.split_seed=2", "split_seed")):
        with pytest.raises(ConfigError, match=rf"\[data\] sets {key} beside \[data.task\].*remove data.{key}"):
            load_run_config(preset="tiny", overrides=task + [extra])
    (tmp_path / "t.toml").write_text('[data]\ncorpus = "notes/"\n[data.task]\nfamily = "maxret"\n')
    with pytest.raises(ConfigError, match=r"t.toml: \[data\] sets corpus beside"):
        load_run_config(tmp_path / "t.toml", preset="tiny")
    assert load_run_config(preset="tiny", overrides=task).data.task.name == "flipflop"


def test_yaml_reads_floats_as_yaml_1_2_keeps_quoted_strings_and_refuses_a_repeated_key(tmp_path):
    (tmp_path / "a.yaml").write_text('train: {lr: 3e-4}\ndata: {corpus: "1e3"}\n')
    cfg = load_run_config(tmp_path / "a.yaml")
    assert cfg.train.lr == 3e-4 and cfg.data.corpus == "1e3"  # unquoted: a float; quoted: the text it says
    (tmp_path / "b.yaml").write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="cannot parse .*b.yaml.*key 'lr' is given twice"):
        load_run_config(tmp_path / "b.yaml")


def test_set_reaches_nested_tables_and_checks_their_keys(tmp_path):
    sections = {"data": {"mixture": {"qa": 0.1}}, "train": {}}
    apply_overrides(sections, ["data.mixture.needle=0.2", "data.mixture.seed=3", "train.lr=1e-3"])
    assert sections["data"] == {"mixture": {"qa": 0.1, "needle": 0.2, "seed": 3}} and sections["train"]["lr"] == 1e-3
    (tmp_path / "m.toml").write_text("[data.mixture]\nneedle = 0.1\n")
    cfg = load_run_config(tmp_path / "m.toml", overrides=["data.mixture.icl=0.05"])
    assert (cfg.data.mixture.needle, cfg.data.mixture.icl, cfg.data.mixture.qa) == (0.1, 0.05, 0.0)
    with pytest.raises(ConfigError, match=r"unknown key 'neede' in \[data.mixture\] \(did you mean 'needle'\?\)"):
        load_run_config(overrides=["data.mixture.neede=0.1"])
    with pytest.raises(ConfigError, match="data.corpus is a single value, not a table"):
        load_run_config(overrides=["data.corpus=notes/", "data.corpus.x=1"])
    (tmp_path / "bad.toml").write_text("[data.mixture]\nqa = 0.1\nicll = 0.2\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key 'icll' in \[data.mixture\] \(did you mean 'icl'\?\)"):
        load_run_config(tmp_path / "bad.toml")


SHIPPED = sorted((Path(__file__).resolve().parents[1] / "configs").rglob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_a_task_config_fits_its_task(path):
    """A config in configs/ loads as `train` and `compare` read it; a synthetic task's model has an embedding for every
    word of the task (its two specials included) and trains on its longest sequence, so nothing is cut or unknown."""
    from difftransformer.data.ood.families import SPECIALS

    cfg = load_run_config(path)
    task = cfg.data.task
    if task is not None:
        assert cfg.model.vocab_size >= len(SPECIALS) + len(task.vocab()), path
        assert cfg.train.seq_len >= task.max_length(), path
        assert cfg.model.max_position_embeddings >= cfg.train.seq_len, path
