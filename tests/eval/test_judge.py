"""The faithfulness judges: the matching rule on hand-made records, the Python-callable and external-command
forms, and their failure modes as one-line errors."""

from __future__ import annotations

import shlex
import sys

import pytest

from difftransformer.eval.judge import (
    CallableJudge,
    CommandJudge,
    MatchJudge,
    make_judge,
    match_verdict,
    normalize,
    occurs,
)

CONTEXT = ("The Congress met in December. Maria Lopez was born in Lyon. She paid 12,500 dollars for the farm in "
           "1874, when Rome was far away.")
CITIES = ["Lyon", "Paris", "Rome", "Porto"]


def record(output: str, reference: str = "Lyon", **extra) -> dict:
    return {"context": CONTEXT, "question": "Where was Maria Lopez born?", "answer_prefix": "Maria Lopez was born in",
            "output": output, "reference": reference, "candidates": CITIES, **extra}


def faithful(output: str, **kw) -> bool:
    return match_verdict(record(output, **kw))["faithful"]


def test_normalisation_of_words_and_numbers():
    assert normalize("  Lyon, FRANCE!  ") == ["lyon", "france"]
    assert normalize("12,500 and 12500.00 and $12,500") == ["12500", "and", "12500", "and", "12500"]
    assert normalize("007 3.50 0.0 1,2,3") == ["7", "3.5", "0", "1", "2", "3"]
    assert normalize("12,5000") == ["12", "5000"]  # not a thousands group: two numbers
    assert normalize("1990.") == ["1990"] and normalize("born in 1990. Then") == ["born", "in", "1990", "then"]
    assert normalize("") == [] and normalize(" ... ,; ") == []
    assert occurs("Mount Fuji", "it is mount   fuji.") and not occurs("Rome", "Romeo") and not occurs("1990", "19901")


def test_an_answer_copied_from_the_context_is_faithful():
    v = match_verdict(record(" Lyon."))
    assert v == {"faithful": True, "reason": v["reason"], "spans": []}
    assert faithful("lyon") and faithful("Lyon, in 1874") and faithful(" Lyon, far from Rome")  # all in the context


def test_an_answer_not_in_the_context_is_unfaithful():
    v = match_verdict(record(" Paris."))
    assert not v["faithful"] and "does not state" in v["reason"]
    assert not faithful("Ly") and not faithful("Lyonnais")  # whole tokens only


def test_a_contradicting_candidate_not_in_the_context_makes_it_unfaithful():
    v = match_verdict(record(" Lyon, or maybe Paris."))
    assert not v["faithful"] and v["spans"] == ["Paris"]
    assert match_verdict(record(" Lyon or Porto or Paris"))["spans"] == ["Porto", "Paris"]
    assert faithful("Lyon or Rome")  # Rome is in the context: supported, allowed (Lookback Lens rule)
    assert faithful("Lyon and Paris", candidates=[])  # an unlisted word is not checked


def test_numbers_are_compared_in_canonical_form():
    for out in ("12500", "12,500", "12,500.00", "$12,500 dollars", "012500"):
        assert faithful(out, reference="12,500"), out
    assert not faithful("125000", reference="12,500")
    v = match_verdict(record("12,500 or 13,000", reference="12,500"))
    assert not v["faithful"] and v["spans"] == ["13,000"]
    assert not faithful("Lyon in 1875")  # a number the context does not contain
    assert faithful("Lyon in 1874")
    assert faithful("1874", reference="1874") and not faithful("18745", reference="1874")
    # the reference's own numbers count as supported even when the context writes them otherwise
    assert match_verdict({"context": "a week has seven days", "output": "7", "reference": "7"})["faithful"]


def test_empty_output_is_unfaithful():
    for out in ("", "   ", ". ,\n"):
        v = match_verdict(record(out))
        assert v == {"faithful": False, "reason": "empty output", "spans": []}


def test_references_are_alternatives_and_a_record_needs_one():
    assert faithful("Lugdunum", reference=None, references=["Lyon", "Lugdunum"])
    with pytest.raises(ValueError, match="record 0 has no usable 'reference'"):
        match_verdict({"context": CONTEXT, "output": "Lyon"})
    with pytest.raises(ValueError, match="record 3 has no 'output' string"):
        match_verdict({"context": CONTEXT, "reference": "Lyon"}, 3)
    assert MatchJudge()([record("Lyon"), record("Paris")]) == [match_verdict(record("Lyon")),
                                                                match_verdict(record("Paris"))]


# ---------------------------------------------------------------- the Python callable


def says_lyon(records):
    """An importable judge for the 'python:' spec: faithful when the output says Lyon."""
    return [{"faithful": "Lyon" in r["output"], "reason": "mine"} for r in records]


def test_a_python_callable_judges():
    seen = []

    def fn(records):
        seen.extend(records)
        return [True, False]

    judge = make_judge(fn)
    assert judge([record("Lyon"), record("Lyon")]) == [{"faithful": True}, {"faithful": False}]
    assert [r["output"] for r in seen] == ["Lyon", "Lyon"] and judge.name.endswith("fn")
    imported = make_judge("python:tests.eval.test_judge:says_lyon")
    assert imported([record("Lyon"), record("Paris")]) == [{"faithful": True, "reason": "mine"},
                                                          {"faithful": False, "reason": "mine"}]
    assert imported.name == "python:tests.eval.test_judge:says_lyon" and imported([]) == []


@pytest.mark.parametrize("returned, message", [
    ([True], "returned 1 verdicts for 2 records"),
    ("yes", "returned 'yes' \\(str\\); a judge returns a list"),
    ([True, "yes"], "returned 'yes' for record 1; each verdict must be true/false or an object"),
    ([True, {"faithful": 1}], "for record 1; each verdict must be"),
])
def test_a_python_callable_that_answers_badly_is_a_one_line_error(returned, message):
    with pytest.raises(ValueError, match=message) as e:
        CallableJudge(lambda records: returned)([record("Lyon"), record("Lyon")])
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the external command


def python_command(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


ECHO_JUDGE = """
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"faithful": "Lyon" in r["output"], "reason": r["reference"], "n": len(r["context"])}))
    print()
"""


def test_an_external_command_judges_records_over_json_lines():
    judge = make_judge("command:" + python_command(ECHO_JUDGE))
    got = judge([record("Lyon."), record("Paris"), record("née à Lyon", reference="Lyon")])
    assert [v["faithful"] for v in got] == [True, False, True]  # blank lines ignored, order kept, UTF-8 intact
    assert got[0] == {"faithful": True, "reason": "Lyon", "n": len(CONTEXT)}
    assert judge([]) == []


@pytest.mark.parametrize("code, message", [
    ("import sys; sys.stderr.write('boom\\nsecond line'); sys.exit(3)",
     "exited with status 3; it printed: boom\\\\nsecond line"),
    ("import sys; sys.stdin.read(); print('{\"faithful\": true}')", "printed 1 lines for 2 records"),
    ("import sys; sys.stdin.read(); print('not json'); print('{}')", "printed line 1 that is not a JSON object"),
    ("import sys; sys.stdin.read(); print('{\"faithful\": true}'); print('{\"faithful\": \"no\"}')",
     "printed line 2 that is not a JSON object with a boolean 'faithful'"),
    ("import time; time.sleep(30)", "did not finish within 0.5 s"),
])
def test_a_failing_command_is_a_one_line_error_naming_it(code, message):
    # Only the sleeping command is meant to time out; the others get time to start Python on a busy machine.
    judge = CommandJudge(python_command(code), timeout_s=0.5 if "sleep" in code else 60.0)
    with pytest.raises(ValueError, match=f"judge command .*-c .*{message}") as e:
        judge([record("Lyon"), record("Paris")])
    assert "\n" not in str(e.value)


def test_a_missing_command_says_what_the_shell_printed():
    with pytest.raises(ValueError, match="judge command 'no-such-judge-xyz' exited with status 127; it printed: .*"
                                         "not found"):
        make_judge("command:no-such-judge-xyz")([record("Lyon")])


@pytest.mark.parametrize("spec, message", [
    ("gpt-4o", "unknown judge 'gpt-4o'; give 'match', 'python:package.module:function' or 'command:"),
    ("command:  ", "names no command"),
    ("python:json", "must name 'package.module:function'"),
    ("python:no_such_module_xyz:judge", "cannot import 'no_such_module_xyz' \\(ModuleNotFoundError"),
    ("python:json:no_such_function", "module 'json' has no 'no_such_function'"),
    ("python:json:__doc__", "'__doc__' is not callable"),
    (3, "neither a callable nor a string"),
])
def test_bad_judge_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        make_judge(spec)
