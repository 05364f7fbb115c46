"""Crash-safe checkpoints: safetensors + JSON only (loading never unpickles), written atomically.

Layout of out_dir/checkpoints/:
    step_00000200/  model.safetensors       weights (a tied LM head stored once, re-aliased on load)
                    optimizer.safetensors   AdamW state tensors as "<param name>::<key>"
                    model_config.json, train_config.json
                    state.json              step, scheduler, RNG states, optimizer param groups,
                                            sha256 of every other file, and a hash of itself
    latest          text file naming the newest complete step directory

A checkpoint is written into step_X.tmp/, every file is fsynced, the directory is renamed into place
(os.replace is atomic), and only then is `latest` replaced (temp file, fsync, os.replace).
A kill -9 at any moment therefore leaves `latest` naming a complete, verifiable checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from difftransformer._io import (
    atomic_write_text,
    canonical_safetensors,
    default_permissions,
    fsync_dir,
    fsync_file,
    writing,
)
from difftransformer.model import DiffTransformerConfig
from difftransformer.model.serialization import WEIGHTS_NAME
from difftransformer.train.config import TrainConfig

log = logging.getLogger("difftransformer.train")

FORMAT = "difftransformer-checkpoint-v1"
CHECKPOINTS_DIR = "checkpoints"  # where a run folder keeps its checkpoints (see run_dir.py)
LATEST = "latest"
MODEL_FILE = WEIGHTS_NAME  # the weights, in the same file format as a pretrained folder
OPTIM_FILE, STATE_FILE = "optimizer.safetensors", "state.json"
MODEL_CONFIG_FILE, TRAIN_CONFIG_FILE = "model_config.json", "train_config.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_SEP = "::"  # parameter names contain dots, so optimizer keys use another separator


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupted, or does not match the run that tries to resume from it."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# -- hashing and durable writes ------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _json_digest(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# -- model and optimizer state <-> flat tensors ----------------------------------------------------
def dedup_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that alias an earlier entry (a tied LM head): (unique tensors, {alias: kept name})."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.detach().to("cpu").contiguous()
    return unique, aliases


def optimizer_state_by_name(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() re-keyed from positions to parameter names (groups carry "names")."""
    sd = optimizer.state_dict()
    index_to_name: dict[int, str] = {}
    for group in sd["param_groups"]:
        index_to_name.update(zip(group["params"], group["names"]))
    return {
        "state": {index_to_name[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": list(g["names"])} for g in sd["param_groups"]],
    }


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, named: Mapping[str, Any]) -> None:
    """Inverse of optimizer_state_by_name; the parameter groups must hold the same names."""
    current = optimizer.state_dict()["param_groups"]
    saved = named["param_groups"]
    if [g["names"] for g in current] != [g["params"] for g in saved]:
        raise CheckpointError("the optimizer's parameter groups in the checkpoint do not match this model's "
                              "(different decay flags or model?); resume with the same decay settings")
    name_to_index = {n: i for g in current for n, i in zip(g["names"], g["params"])}
    groups = [{**g, "params": [name_to_index[n] for n in g["params"]]} for g in saved]
    state = {name_to_index[n]: dict(s) for n, s in named["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def flatten_optimizer_state(named: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors for safetensors, the rest (param groups, scalar state) as JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pname, entries in named["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pname}{_SEP}{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(pname, {})[key] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in named["param_groups"]]
    return tensors, {"param_groups": groups, "scalar_state": scalars}


def unflatten_optimizer_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for flat, value in tensors.items():
        pname, key = flat.rsplit(_SEP, 1)
        state.setdefault(pname, {})[key] = value
    for pname, entries in meta.get("scalar_state", {}).items():
        state.setdefault(pname, {}).update(entries)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g) for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# -- RNG states as JSON --------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np.asarray(np_state[1]).tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [_unb64(s) for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# -- save ----------------------------------------------------------------------------------------
def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories (renamed into place, with a state.json), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _read_latest(root: Path) -> Path | None:
    """The step folder `latest` names, if it names one of this folder's (never a path elsewhere)."""
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _STEP_DIR.match(name):
        log.warning("%s holds %r, not a step folder name; it is ignored", root / LATEST, name[:80])
        return None
    return root / name


def save_checkpoint(
    root: str | Path,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    state: Mapping[str, Any],
    model_config: DiffTransformerConfig,
    train_config: TrainConfig,
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, then prune to `keep_last` checkpoints.

    model_state: name -> tensor (aliases are detected and stored once); optimizer_state: the
    name-keyed form of optimizer_state_by_name; state: extra JSON (scheduler, RNG, metrics...).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    for stale in root.glob("step_*.tmp"):  # left behind by a crash mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    try:
        with writing(final):
            _write_step(tmp, step, model_state, optimizer_state, state, model_config, train_config)
    except BaseException:  # a full disk gets its space back; `latest` still names the previous checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    if final.exists():  # a complete copy from an interrupted earlier attempt at this step
        aside = root / (final.name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, final.name + "\n", fsync=True)

    for _, old in list_checkpoints(root)[:-keep_last]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write_step(tmp: Path, step: int, model_state: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, Any],
                state: Mapping[str, Any], model_config: DiffTransformerConfig, train_config: TrainConfig) -> None:
    """Write every file of checkpoint `step` into the folder `tmp` and fsync them (save_checkpoint's body)."""
    weights, aliases = dedup_tensors(model_state)
    save_file(weights, str(tmp / MODEL_FILE), metadata={"format": "pt", "step": str(step)})
    optim_tensors, optim_meta = flatten_optimizer_state(optimizer_state)
    save_file(optim_tensors, str(tmp / OPTIM_FILE), metadata={"format": "pt", "step": str(step)})
    for name in (MODEL_FILE, OPTIM_FILE):
        canonical_safetensors(tmp / name)  # the same state gives the same bytes (and checksums)
        default_permissions(tmp / name)
    model_config.save(tmp / MODEL_CONFIG_FILE)
    train_config.save(tmp / TRAIN_CONFIG_FILE)
    files = {}
    for name in (MODEL_FILE, OPTIM_FILE, MODEL_CONFIG_FILE, TRAIN_CONFIG_FILE):
        fsync_file(tmp / name)
        files[name] = sha256_file(tmp / name)
    payload = {"format": FORMAT, "step": step, **state, "optimizer": optim_meta, "tied_weights": aliases,
               "files": files}
    payload["state_sha256"] = _json_digest(payload)
    with open(tmp / STATE_FILE, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)


# -- load ----------------------------------------------------------------------------------------
def find_latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names; if it is missing, the newest complete one (with a warning)."""
    root = Path(root)
    named = _read_latest(root)
    if named is not None and (named / STATE_FILE).is_file():
        return named
    found = list_checkpoints(root)
    if not found:
        return None
    log.warning("%s does not name a complete checkpoint; using the newest complete one, %s",
                root / LATEST, found[-1][1])
    return found[-1][1]


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a step directory, a checkpoints/ folder (via `latest`) or a run's out_dir."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for root in (path, path / CHECKPOINTS_DIR):
        if root.is_dir() and ((root / LATEST).exists() or list_checkpoints(root)):
            found = find_latest(root)
            if found is not None:
                return found
    raise CheckpointError(f"no checkpoint at {path}: expected a step_XXXXXXXX directory with {STATE_FILE}, "
                          f"a checkpoints/ folder with a '{LATEST}' file, or a run directory containing one")


def _corrupt(ckpt: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {ckpt} is corrupted: {what}. Delete that checkpoint directory to resume "
                           f"from an older one, or start over with --no-resume (resume=False)")


def verify_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """Parse state.json and check the sha256 of every file it lists; returns the parsed state."""
    ckpt = Path(ckpt)
    try:
        state = json.loads((ckpt / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} has no {STATE_FILE}; it is incomplete") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupt(ckpt, f"{STATE_FILE} is not valid JSON ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise _corrupt(ckpt, f"{STATE_FILE} is not a {FORMAT} state file")
    claimed = state.pop("state_sha256", None)
    if claimed != _json_digest(state):
        raise _corrupt(ckpt, f"{STATE_FILE} does not match its own checksum")
    if not isinstance(state.get("files"), dict) or "step" not in state:
        raise _corrupt(ckpt, f"{STATE_FILE} lacks its list of files or its step")
    for name, digest in state["files"].items():
        f = ckpt / name
        if not f.is_file():
            raise _corrupt(ckpt, f"{name} is missing")
        if sha256_file(f) != digest:
            raise _corrupt(ckpt, f"sha256 of {name} does not match the one recorded in {STATE_FILE}")
    return state


def load_checkpoint(path: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify and load a checkpoint (a step dir, a checkpoints/ folder, or a run dir) without unpickling.

    Returns {"path", "step", "model_config" (DiffTransformerConfig), "train_config" (TrainConfig),
    "model" (state dict, tied aliases filled in, loadable with load_state_dict), "optimizer" (state keyed
    by parameter name), "state" (the rest of state.json: scheduler, rng, metrics, data...)}.
    """
    ckpt = resolve_checkpoint(path)
    state = verify_checkpoint(ckpt)
    device = str(map_location)
    try:
        model = load_file(str(ckpt / MODEL_FILE), device=device)
        optim_tensors = load_file(str(ckpt / OPTIM_FILE), device=device)
    except SafetensorError as e:  # only reachable if a file changed after verification
        raise _corrupt(ckpt, f"unreadable safetensors file ({e})") from e
    for alias, kept in state.get("tied_weights", {}).items():
        model[alias] = model[kept]
    try:
        model_config = DiffTransformerConfig.load(ckpt / MODEL_CONFIG_FILE)
        train_config = TrainConfig.load(ckpt / TRAIN_CONFIG_FILE)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt} has a config this version cannot read: {e}") from e
    return {
        "path": ckpt,
        "step": int(state["step"]),
        "model_config": model_config,
        "train_config": train_config,
        "model": model,
        "optimizer": unflatten_optimizer_state(optim_tensors, state["optimizer"]),
        "state": state,
    }
