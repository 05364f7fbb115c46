"""Judges of contextual faithfulness: is a model's output supported by the context it was given?

The paper (§3.6, the Lookback Lens protocol) hands each output and its document to a GPT-4o judge
that answers True/False ("if the summary contains any information not found in the document, it is
false") and lists the problematic spans. No such judge runs offline, so the default here is a
matching judge for tasks whose answer is fully determined by the context; users who have an LLM
judge plug it in as a Python callable or as an external command.

A record is a dict:

    {"context": str,                  # the document the model read
     "question": str,                 # or "instruction": what it was asked (either, or neither)
     "answer_prefix": str,            # optional: the prompt's last words, which the output continues
     "output": str,                   # the model's continuation
     "reference": str,                # the in-context answer, or "references": [str, ...] (any one)
     "candidates": [str, ...]}        # optional: answers of the same kind (other cities, years, ...)

and a verdict is a dict {"faithful": bool, "reason": str, "spans": [str, ...]} (an external judge
may leave out "reason" and "spans"). A judge is called on a list of records and returns one verdict
per record, in order:

    judge = make_judge("match")                                   # the offline default
    judge = make_judge("python:mypackage.judges:gpt_judge")       # fn(records) -> [verdict or bool, ...]
    judge = make_judge("command:python my_judge.py", timeout_s=600)
    judge = make_judge(my_function)                               # any callable, same contract
    verdicts = judge(records)

The matching judge (`match_verdict`), precisely. Texts are normalised to word tokens: Unicode NFKC,
lower case, every run of letters one token, every number one token in canonical form (thousands
separators dropped: "12,500" = "12500"; leading zeros and trailing decimal zeros dropped: "007" = "7",
"3.50" = "3.5"); punctuation and spacing are ignored. Number words ("seven") are words, not numbers.
A phrase occurs in a text when its tokens appear there contiguously (so "1990" does not occur in
"19901", nor "Rome" in "Romeo"). The source is context + question/instruction + answer_prefix. Then
the output is
  - unfaithful when it is empty (no tokens): "empty output";
  - unfaithful when no reference occurs in it: it does not state the in-context fact;
  - unfaithful when it contains a contradicting candidate that the source does not contain: a
    number, or a phrase from "candidates" (one that is not part of a reference), absent from the
    source (the numbers of a reference count as in the source). A candidate the source does contain
    (another fact of the document) is supported and allowed, as in the Lookback Lens rule, which asks
    only whether the information is in the document;
  - faithful otherwise. Words other than numbers and listed candidates are not checked: a matching
    judge cannot tell new information from paraphrase, so the task bounds the output it judges.
"spans" lists the output's offending text (the unsupported candidates as written, in output order).

An external command gets the records as JSON lines on its stdin and must print one JSON object per
record on stdout, in order, each with a boolean "faithful" (blank lines are ignored). A command that
exits non-zero, runs past its timeout, prints the wrong number of lines or a line that is not such an
object is a one-line ValueError naming the command and what it printed.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

Record = dict[str, Any]
Verdict = dict[str, Any]

MATCH = "match"
PYTHON_PREFIX = "python:"
COMMAND_PREFIX = "command:"
DEFAULT_TIMEOUT_S = 600.0
_JUDGE_SPECS = f"'{MATCH}', '{PYTHON_PREFIX}package.module:function' or '{COMMAND_PREFIX}<shell command>'"

# A number with thousands separators (each group exactly three digits), or plain digits; either with
# an optional decimal part. The look-arounds keep "12,5000" from reading as 12,500 + 0.
_NUMBER = r"(?<![\d,])\d{1,3}(?:,\d{3})+(?![\d])(?:\.\d+)?|\d+(?:\.\d+)?"
_TOKEN = re.compile(rf"(?P<num>{_NUMBER})|(?P<word>[^\W\d_]+)")


# ---------------------------------------------------------------- normalisation


def _canonical_number(text: str) -> str:
    whole, _, frac = text.replace(",", "").partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    return f"{whole}.{frac}" if frac else whole


def tokens_with_spans(text: str) -> list[tuple[str, int, int, bool]]:
    """(normalised token, start, end, is_number) for every word and number of `text`, in order."""
    text = unicodedata.normalize("NFKC", text)
    out = []
    for m in _TOKEN.finditer(text):
        if m.group("num") is not None:
            out.append((_canonical_number(m.group("num")), m.start(), m.end(), True))
        else:
            out.append((m.group("word").lower(), m.start(), m.end(), False))
    return out


def normalize(text: str) -> list[str]:
    """The normalised tokens of `text` (see the module doc): what the matching judge compares."""
    return [t[0] for t in tokens_with_spans(text)]


def find_phrase(haystack: Sequence[str], phrase: Sequence[str]) -> int:
    """Index of the first contiguous occurrence of `phrase` in `haystack` (token lists), or -1."""
    n = len(phrase)
    if n == 0:
        return -1
    for i in range(len(haystack) - n + 1):
        if list(haystack[i:i + n]) == list(phrase):
            return i
    return -1


def occurs(phrase: str, text: str) -> bool:
    """Whether `phrase` occurs in `text` after normalisation (contiguous whole tokens)."""
    return find_phrase(normalize(text), normalize(phrase)) >= 0


# ---------------------------------------------------------------- the matching judge


def references_of(record: Record, index: int = 0) -> list[str]:
    """The record's reference answers ("reference" or "references"); a record without one is a ValueError."""
    refs = record.get("references", record.get("reference"))
    if isinstance(refs, str):
        refs = [refs]
    if not isinstance(refs, (list, tuple)) or not refs or not all(isinstance(r, str) and normalize(r) for r in refs):
        raise ValueError(f"record {index} has no usable 'reference' (a non-empty string) or 'references' (a list "
                         f"of them), got {refs!r}; the matching judge compares the output with it")
    return list(refs)


def _source_text(record: Record) -> str:
    parts = [record.get(k) for k in ("context", "question", "instruction", "answer_prefix")]
    return "\n".join(p for p in parts if isinstance(p, str))


def match_verdict(record: Record, index: int = 0) -> Verdict:
    """The matching judge's verdict on one record (the rule is in the module doc)."""
    output = record.get("output")
    if not isinstance(output, str):
        raise ValueError(f"record {index} has no 'output' string (got {output!r}); give the model's output")
    refs = [normalize(r) for r in references_of(record, index)]
    out = tokens_with_spans(output)
    words = [t[0] for t in out]
    if not words:
        return {"faithful": False, "reason": "empty output", "spans": []}
    if not any(find_phrase(words, r) >= 0 for r in refs):
        return {"faithful": False, "reason": "does not state the in-context answer", "spans": [output.strip()]}
    source_tokens = tokens_with_spans(_source_text(record))
    source = [t[0] for t in source_tokens]
    source_numbers = {t[0] for t in source_tokens if t[3]} | {t for r in refs for t in r if t[0].isdigit()}
    found: set[tuple[int, int]] = set()  # (start, end) in the output of each unsupported candidate
    for tok, start, end, is_number in out:
        if is_number and tok not in source_numbers:
            found.add((start, end))
    for cand in record.get("candidates") or []:
        c = normalize(cand)
        if not c or any(find_phrase(r, c) >= 0 for r in refs) or find_phrase(source, c) >= 0:
            continue
        i = find_phrase(words, c)
        if i >= 0:
            found.add((out[i][1], out[i + len(c) - 1][2]))
    if found:
        return {"faithful": False, "reason": "states something the context does not contain",
                "spans": [output[a:b] for a, b in sorted(found)]}
    return {"faithful": True, "reason": "states the in-context answer and nothing that contradicts the context",
            "spans": []}


class MatchJudge:
    """The offline default: `match_verdict` on every record."""

    name = MATCH

    def __call__(self, records: Sequence[Record]) -> list[Verdict]:
        return [match_verdict(r, i) for i, r in enumerate(records)]


# ---------------------------------------------------------------- pluggable judges


def _excerpt(text: str, limit: int = 200) -> str:
    """`text` on one line (newlines escaped), cut to `limit` characters: for error messages."""
    text = text.strip().replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


def check_verdicts(verdicts: Any, count: int, who: str) -> list[Verdict]:
    """`verdicts` as a list of `count` verdict dicts, or a one-line ValueError naming `who` (the judge).

    Each item may be a bool or a dict with a boolean "faithful" (other keys kept when JSON-able)."""
    if not isinstance(verdicts, (list, tuple)):
        raise ValueError(f"{who} returned {_excerpt(repr(verdicts))} ({type(verdicts).__name__}); a judge returns "
                         f"a list with one verdict per record")
    if len(verdicts) != count:
        raise ValueError(f"{who} returned {len(verdicts)} verdicts for {count} records; a judge returns one "
                         f"verdict per record, in order")
    out = []
    for i, v in enumerate(verdicts):
        if isinstance(v, bool):
            v = {"faithful": v}
        if not isinstance(v, dict) or not isinstance(v.get("faithful"), bool):
            raise ValueError(f"{who} returned {_excerpt(repr(v))} for record {i}; each verdict must be true/false "
                             f"or an object with a boolean 'faithful'")
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            v = {"faithful": v["faithful"], "reason": _excerpt(str(v.get("reason", "")))}
        out.append(dict(v))
    return out


class CallableJudge:
    """A Python function `fn(records) -> [verdict or bool, ...]` (one per record) used as a judge."""

    def __init__(self, fn: Callable[[list[Record]], Any], name: str | None = None):
        if not callable(fn):
            raise ValueError(f"judge {fn!r} is not callable; give a function fn(records) -> list of verdicts")
        self.fn = fn
        self.name = name or f"python:{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"

    def __call__(self, records: Sequence[Record]) -> list[Verdict]:
        """The function's verdicts, checked. A function that raises (one that does not take the records,
        such as python:os:getcwd, or a judge of one's own that fails) is a one-line ValueError naming the
        judge and its contract, like every other bad judge; the original error is chained to it, so
        DIFFTRANSFORMER_DEBUG=1 shows its traceback."""
        if not records:
            return []
        try:
            verdicts = self.fn([dict(r) for r in records])
        except Exception as e:
            raise ValueError(f"judge {self.name} raised {type(e).__name__}: {_excerpt(str(e))}; a judge is a function "
                             f"fn(records) -> one verdict per record") from e
        return check_verdicts(verdicts, len(records), f"judge {self.name}")


class CommandJudge:
    """An external command: records as JSON lines on stdin, one JSON verdict object per line on stdout."""

    def __init__(self, command: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not command.strip():
            raise ValueError(f"judge '{COMMAND_PREFIX}' names no command; write {COMMAND_PREFIX}<shell command>, "
                             f"e.g. '{COMMAND_PREFIX}python my_judge.py'")
        if not timeout_s > 0:
            raise ValueError(f"the judge timeout must be positive seconds, got {timeout_s!r}")
        self.command, self.timeout_s = command, timeout_s
        self.name = COMMAND_PREFIX + command

    def __call__(self, records: Sequence[Record]) -> list[Verdict]:
        if not records:
            return []
        payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        stdout = self._run(payload)
        lines = [line for line in stdout.splitlines() if line.strip()]
        who = f"judge command {self.command!r}"
        if len(lines) != len(records):
            raise ValueError(f"{who} printed {len(lines)} lines for {len(records)} records (one JSON object per "
                             f"record expected): {_excerpt(stdout) or '(nothing)'}")
        verdicts = []
        for i, line in enumerate(lines):
            try:
                v = json.loads(line)
            except json.JSONDecodeError:
                v = None
            if not isinstance(v, dict) or not isinstance(v.get("faithful"), bool):
                raise ValueError(f"{who} printed line {i + 1} that is not a JSON object with a boolean 'faithful': "
                                 f"{_excerpt(line)}")
            verdicts.append(v)
        return verdicts

    def _run(self, payload: str) -> str:
        """The command's stdout; a timeout or a non-zero exit is a one-line ValueError. The command runs in
        its own process group so that a timeout ends everything it started."""
        who = f"judge command {self.command!r}"
        try:
            proc = subprocess.Popen(self.command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
                                    start_new_session=True)
        except OSError as e:
            raise ValueError(f"{who} could not start: {e}") from None
        try:
            stdout, stderr = proc.communicate(payload, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            stdout, _ = proc.communicate()
            raise ValueError(f"{who} did not finish within {self.timeout_s:g} s (printed so far: "
                             f"{_excerpt(stdout) or 'nothing'}); raise the judge timeout or check the command"
                             ) from None
        if proc.returncode != 0:
            raise ValueError(f"{who} exited with status {proc.returncode}; it printed: "
                             f"{_excerpt(stderr or stdout) or '(nothing)'}")
        return stdout


def _import_function(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"judge '{PYTHON_PREFIX}{path}' must name 'package.module:function' after "
                         f"'{PYTHON_PREFIX}', e.g. '{PYTHON_PREFIX}mypackage.judges:judge'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure of the user's module is their input, reported in one line
        raise ValueError(f"judge '{PYTHON_PREFIX}{path}': cannot import {module_name!r} "
                         f"({type(e).__name__}: {_excerpt(str(e))}); is it on PYTHONPATH?") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"judge '{PYTHON_PREFIX}{path}': module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"judge '{PYTHON_PREFIX}{path}': {attr!r} is not callable; name a function "
                         f"fn(records) -> list of verdicts")
    return fn


def make_judge(spec: str | Callable,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Callable[[Sequence[Record]], list[Verdict]]:
    """The judge `spec` names: "match", "python:package.module:function", "command:<shell command>", or a
    callable (used as is). `timeout_s` bounds an external command. A bad spec is a one-line ValueError."""
    if callable(spec) and not isinstance(spec, str):
        return spec if isinstance(spec, (MatchJudge, CallableJudge, CommandJudge)) else CallableJudge(spec)
    if not isinstance(spec, str):
        raise ValueError(f"judge {spec!r} is neither a callable nor a string; give {_JUDGE_SPECS}")
    if spec == MATCH:
        return MatchJudge()
    if spec.startswith(PYTHON_PREFIX):
        path = spec[len(PYTHON_PREFIX):].strip()
        return CallableJudge(_import_function(path), PYTHON_PREFIX + path)
    if spec.startswith(COMMAND_PREFIX):
        return CommandJudge(spec[len(COMMAND_PREFIX):].strip(), timeout_s)
    raise ValueError(f"unknown judge {spec!r}; give {_JUDGE_SPECS}")


def judge_name(judge: Any) -> str:
    """How a judge is recorded in results: its spec, or the callable's module:name."""
    return getattr(judge, "name", None) or getattr(judge, "__qualname__", repr(judge))


__all__ = ["CallableJudge", "CommandJudge", "MatchJudge", "Record", "Verdict", "check_verdicts", "find_phrase",
           "judge_name", "make_judge", "match_verdict", "normalize", "occurs", "references_of", "tokens_with_spans"]
