"""The synthetic task families (data/ood/): answers recoverable from their prompts, positions and roles right,
seeded and reproducible, train and test never sharing a sequence, out-of-distribution conditions as stated."""

import numpy as np
import pytest
import torch

from difftransformer.data import DataConfig
from difftransformer.data.ood import (
    EOS_ID,
    FAMILIES,
    IGNORE,
    MQAR,
    PAD_ID,
    TRAIN,
    Condition,
    FlipFlop,
    Induction,
    MaxRetrieval,
    family_from_dict,
    partition_bits,
)
from difftransformer.data.ood.episodes import BOS, FILLER, ITEM, PAD, QUERY
from difftransformer.data.ood.sampler import TaskSampler, TaskValSet, _condition_key, eval_set

ALL = [MQAR(), MQAR(key_len=2, value_len=2, min_pairs=4, max_pairs=6, queries=3), FlipFlop(), Induction(),
       MaxRetrieval()]
IDS = ["mqar", "mqar-2tok", "flipflop", "induction", "maxret"]


def words(family, ids):
    vocab = ["<eos>", "<pad>", *family.vocab()]
    return [vocab[i] for i in ids]


def solve(family, tokens):
    """An independent solver: reads the answers of one sequence from its words alone, in order."""
    w = words(family, tokens)
    assert w[0] == "<eos>"
    if isinstance(family, MQAR):
        kl, vl = family.key_len, family.value_len
        sep = w.index("|")
        ctx, pairs, i = w[1:sep], {}, 0
        while i < len(ctx):
            if ctx[i].startswith("k"):
                pairs[tuple(ctx[i:i + kl])] = ctx[i + kl:i + kl + vl]
                i += kl + vl
            else:
                i += 1
        tail, out = w[sep + 1:], []
        for q in range(0, len(tail), kl + vl):
            out += pairs[tuple(tail[q:q + kl])]
        return out
    if isinstance(family, FlipFlop):
        out, last = [], None
        for instr, bit in zip(w[1::2], w[2::2]):
            if instr == "w":
                last = bit
            elif instr == "r":
                out.append(last)
        return out
    if isinstance(family, Induction):
        out, succ = [], {}
        for a, b in zip(w[1:], w[2:]):
            if a.startswith("t"):
                if a in succ:
                    out.append(succ[a])
                succ[a] = b
        return out
    items = [(int(a[1:]), b) for a, b in zip(w[1:], w[2:]) if a.startswith("k")]
    return [max(items)[1]]


@pytest.mark.parametrize("family", ALL, ids=IDS)
def test_every_answer_is_recoverable_from_its_prompt(family):
    e = family.generate(np.random.default_rng(1), 40)
    for b in range(len(e)):
        n = int(e.lengths[b])
        last = [e.targets[b, n - 1]] if e.targets[b, n - 1] != IGNORE else []  # inputs drop the last token
        full = np.concatenate([e.inputs[b, :n], last]).astype(np.int64)
        answers = words(family, e.targets[b][e.targets[b] != IGNORE])
        assert answers == solve(family, full)
        # targets are the next tokens, wherever they are set
        where = np.flatnonzero(e.targets[b] != IGNORE)
        assert (e.targets[b, where] == full[where + 1]).all() and len(where)
        assert e.inputs[b, 0] == EOS_ID and e.role[b, 0] == BOS
        assert (e.inputs[b, n:] == PAD_ID).all() and (e.role[b, n:] == PAD).all()


@pytest.mark.parametrize("family", ALL, ids=IDS)
def test_roles_and_targets_point_at_the_right_positions(family):
    e = family.generate(np.random.default_rng(2), 30)
    for b, t in zip(*np.nonzero(e.answer_mask)):
        item = e.answer_item[b, t]
        before = np.arange(e.inputs.shape[1]) < t
        source = before & (e.support[b] == item)
        assert source.any(), "the answer's item occurs before the answer"
        assert (e.role[b][source] == ITEM).all()
        answer = e.targets[b, t]
        assert answer in e.inputs[b][source], "the answer token is a token of its item"
    assert set(np.unique(e.role)) <= {PAD, BOS, FILLER, ITEM, QUERY}
    assert ((e.support >= 0) == (e.role == ITEM)).all()


@pytest.mark.parametrize("family", ALL, ids=IDS)
def test_the_same_seed_gives_the_same_data_and_another_seed_other_data(family):
    a = family.generate(np.random.default_rng([5, 1]), 16)
    b = family.generate(np.random.default_rng([5, 1]), 16)
    c = family.generate(np.random.default_rng([6, 1]), 16)
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs[:, :10], c.inputs[:, :10])
    s1, s2 = TaskSampler(family, 8, family.max_length(), seed=3), TaskSampler(family, 8, family.max_length(), seed=3)
    assert torch.equal(s1.batch(7)[0], s2.batch(7)[0])
    assert not torch.equal(s1.batch(7)[0], s1.batch(8)[0])


@pytest.mark.parametrize("family", ALL, ids=IDS)
def test_train_and_test_never_share_a_sequence(family):
    sampler = TaskSampler(family, 64, family.max_length(), seed=0)
    train = [sampler.episodes(step) for step in range(4)]
    test = eval_set(family, TRAIN, 200, seed=0)
    assert all((partition_bits(t) == 0).all() for t in train)
    assert (partition_bits(test) == 1).all()
    seen = {tuple(t.inputs[b, :t.lengths[b]]) for t in train for b in range(len(t))}
    assert not any(tuple(test.inputs[b, :test.lengths[b]]) in seen for b in range(len(test)))



def test_equal_conditions_give_the_same_test_set():
    family = FlipFlop()
    a, b = eval_set(family, Condition(length=2), 20), eval_set(family, Condition(length=2.0), 20)
    assert Condition(length=2) == Condition(length=2.0)
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.targets, b.targets)
    # the float keys, as evaluations have always passed them, keep their streams (fixed test sets stay fixed)
    assert [_condition_key(c) for c in (TRAIN, Condition(length=16.0), Condition(density=4.0))] == [
        2376973367, 3352202834, 1500978572]

def test_partition_bit_depends_on_every_token():
    e = MQAR().generate(np.random.default_rng(0), 256)
    bits = partition_bits(e)
    assert 0.35 < bits.mean() < 0.65
    flipped = e.take(np.arange(len(e)))
    flipped.inputs[:, 5] = np.where(flipped.inputs[:, 5] == 100, 101, 100)
    assert (partition_bits(flipped) != bits).any()


def test_sampler_batches_are_padded_windows_with_loss_on_answers_only():
    family = MQAR()
    sampler = TaskSampler(family, 8, 100, seed=1)
    x, y = sampler.batch(0)
    assert x.shape == y.shape == (8, 100) and x.dtype == torch.int64
    e = sampler.episodes(0)
    assert torch.equal(y, torch.from_numpy(e.targets))
    assert ((y != IGNORE).sum(1) == family.queries * family.value_len).all()
    few = TaskSampler(MQAR(min_pairs=1, max_pairs=3, queries=8), 64, 100).episodes(0)
    pairs = [len(np.unique(few.support[b][few.support[b] >= 0])) for b in range(64)]
    assert list((few.answer_query.max(1) + 1)) == pairs, "min(queries, pairs) queries"
    halves = [sampler.batch(0, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x)
    with pytest.raises(ValueError, match="seq_len"):
        TaskSampler(family, 8, family.max_length() - 1)


def test_val_set_is_fixed_and_held_out():
    family = FlipFlop()
    a, b = TaskValSet(family, family.max_length(), 50), TaskValSet(family, family.max_length(), 50)
    assert np.array_equal(a.episodes.inputs, b.episodes.inputs)
    assert (partition_bits(a.episodes) == 1).all()
    batches = list(a.batches(16))
    assert [len(x) for x, _ in batches] == [16, 16, 16, 2]


def test_conditions_scale_length_and_density():
    family = MQAR(min_pairs=8, max_pairs=8, min_context=64, max_context=64)
    rng = np.random.default_rng(0)
    base = family.generate(rng, 8)
    longer = family.generate(rng, 8, Condition(length=4))
    denser = family.generate(rng, 8, Condition(density=2))
    items = lambda e: [len(np.unique(e.support[b][e.support[b] >= 0])) for b in range(len(e))]  # noqa: E731
    assert items(base) == items(longer) == [8] * 8 and items(denser) == [16] * 8
    assert (longer.lengths == 4 * 64 + 1 + 4 * 2).all() and (base.lengths == 64 + 1 + 4 * 2).all()
    assert family.max_length(Condition(length=4)) == int(longer.lengths.max())
    flip = FlipFlop(p_ignore=0.8)
    assert flip.p_ignore_at(Condition(density=2)) == pytest.approx(8 / 9)
    with pytest.raises(ValueError, match="distinct keys"):
        MQAR(num_keys=10).check_condition(Condition(density=2))
    with pytest.raises(ValueError, match="factor"):
        Condition(length=0)
    for n, want in ((3, 5), (5, 8)):  # halves round up alike: 4.5 -> 5 and 7.5 -> 8
        odd = MaxRetrieval(min_items=n, max_items=n).generate(rng, 4, Condition(density=1.5))
        assert items(odd) == [want] * 4



def _answer_distances(e):
    """Tokens from each answer position back to the nearest token of its target item."""
    return np.array([t - np.flatnonzero(e.support[b, :t] == e.answer_item[b, t]).max()
                     for b, t in zip(*np.nonzero(e.answer_mask))])


@pytest.mark.parametrize("family", [Induction(), MaxRetrieval(), FlipFlop()], ids=["induction", "maxret", "flipflop"])
def test_longer_contexts_move_targets_away_except_in_flipflop(family):
    """Families with filler keep their items, so 4x the length puts the target ~4x farther back; flipflop scales its
    instructions at the same odds, so the write-to-read distance stays (the module doc says so)."""
    near = _answer_distances(eval_set(family, TRAIN, 300)).mean()
    far = _answer_distances(eval_set(family, Condition(length=4.0), 300)).mean()
    if isinstance(family, FlipFlop):
        assert far < 1.5 * near
    else:
        assert far > 3 * near

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_max_length_bounds_every_sequence(name):
    family = FAMILIES[name]()
    for c in (TRAIN, Condition(length=2), Condition(density=2)):
        e = family.generate(np.random.default_rng(4), 64, c)
        assert int(e.lengths.max()) <= family.max_length(c)


def test_tokenizer_maps_words_to_the_generated_ids():
    family = MQAR()
    tok = family.tokenizer()
    e = family.generate(np.random.default_rng(0), 2)
    ids = e.inputs[0, :e.lengths[0]].tolist()
    text = tok.decode(ids)
    assert text.split()[1:] == words(family, ids)[1:]
    assert tok.encode(" ".join(words(family, ids)[1:])) == ids[1:]
    prompt, rest = ids[1:6], ids[6:9]
    assert tok.decode(prompt) + tok.decode(rest) == tok.decode(ids[1:9]) == " " + " ".join(words(family, ids[1:9]))
    assert tok.eos_id == EOS_ID and tok.vocab_size == family.vocab_size


def test_task_configs_validate_early_and_name_the_fix():
    assert family_from_dict({"family": "mqar", "min_pairs": 4, "max_pairs": 4}) == MQAR(min_pairs=4, max_pairs=4)
    with pytest.raises(ValueError, match="did you mean 'mqar'"):
        family_from_dict({"family": "mqr"})
    with pytest.raises(ValueError, match="did you mean 'min_pairs'"):
        family_from_dict({"family": "mqar", "min_pair": 4})
    with pytest.raises(ValueError, match="p_ignore"):
        FlipFlop(p_ignore=1.0)
    with pytest.raises(TypeError, match="must be an int"):
        MQAR(min_pairs="8")


def test_data_config_with_a_task_has_its_own_folder_and_record():
    cfg = DataConfig(task={"family": "flipflop", "p_ignore": 0.9})
    assert cfg.resolved_dir().startswith("cache/data/task-flipflop-")
    assert cfg.resolved_dir() != DataConfig(task={"family": "flipflop"}).resolved_dir()
    assert cfg.to_dict()["task"]["p_ignore"] == 0.9 and "task" not in DataConfig().to_dict()
    assert DataConfig(**{**cfg.to_dict()}).task == cfg.task
    with pytest.raises(ValueError, match="no data.mixture"):
        DataConfig(task={"family": "mqar"}, mixture={"needle": 0.1})
    for setting in ({"corpus": "notes/"}, {"vocab_size": 300}, {"tokenizer_path": "t.json"}, {"split_seed": 2},
                    {"val_fraction": 0.1}, {"test_fraction": 0.0}):
        (name, value), = setting.items()
        with pytest.raises(ValueError, match=rf"uses no corpus, but data.{name} = {value!r} is set beside it"):
            DataConfig(task={"family": "mqar"}, **setting)


def test_a_prepared_task_folder_is_reused_without_its_lock(tmp_path, monkeypatch):
    """Runs of one study started side by side share the task's folder: once it holds this task's settings and
    tokenizer, preparing it again reads it and never takes the lock (which refuses a second holder); another
    task's settings or a damaged tokenizer file prepare it again, under the lock."""
    from difftransformer.data import prepare as prep

    family = FlipFlop(p_ignore=0.8)
    first = prep.prepare_task(family, tmp_path)
    locked = []
    real_lock = prep.folder_lock

    def spy(*args, **kwargs):
        locked.append(args[0])
        return real_lock(*args, **kwargs)

    monkeypatch.setattr(prep, "folder_lock", spy)
    again = prep.prepare_task(FlipFlop(p_ignore=0.8), tmp_path)
    assert locked == [] and again.corpus_hash == first.corpus_hash and again.task == first.task
    prep.prepare_task(FlipFlop(p_ignore=0.9), tmp_path)  # other settings: prepared again
    assert len(locked) == 1 and prep.PreparedData.load(tmp_path).task["p_ignore"] == 0.9
    (tmp_path / "tokenizer.json").write_text("{}")
    prep.prepare_task(FlipFlop(p_ignore=0.9), tmp_path)  # an unreadable tokenizer: prepared again
    assert len(locked) == 2 and prep._prepared_task(FlipFlop(p_ignore=0.9), tmp_path) is not None
