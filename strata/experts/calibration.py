"""Saved calibrations: what `strata calibrate` (strata.bench.calibrate) found best per machine + model + budget,
and how the engine reads it back (`load_calibration`, `apply_calibration`; a flag the user set always wins).
Beside the cost model (strata.experts.costs), which calibrate also saves: both are read below the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("strata")

FORMAT, VERSION = "strata-calibration", 1


@dataclass(frozen=True)
class Setting:
    """The knobs calibrate tunes (the engine flags of the same names)."""

    threads: int  # --cpu-threads (0 = physical cores)
    cpu_plan: str  # --cpu-plan: auto, or one CPU share per miss count
    cache_policy: str  # --cache-policy
    promote_min: float  # --promote-min (lfu-decay only)
    swap_budget: int  # --swap-budget

    def flags(self) -> list[str]:
        return ["--cpu-threads", str(self.threads), "--cpu-plan", self.cpu_plan, "--cache-policy", self.cache_policy,
                "--promote-min", f"{self.promote_min:g}", "--swap-budget", str(self.swap_budget)]

    def diff(self, other: "Setting") -> dict:
        """{knob: (self's value, other's value)} where they differ."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)}



def calibration_dir() -> Path:
    from strata.config import cache_dir

    return cache_dir() / "calibration"


def model_key(model_path: str | os.PathLike) -> str:
    """The model file by name and size (a re-download of the same file keeps its calibration)."""
    p = Path(model_path)
    try:
        size = p.stat().st_size
    except OSError:
        size = -1
    return f"{p.name}:{size}"


def budget_key(device: str, vram_gb: float | None, slots: int | None) -> str:
    """What decides the cache's size (and so which knobs win): the device and the VRAM budget or slot count."""
    return f"device={device} vram_gb={vram_gb} slots={slots}"


def calibration_path(model_path: str | os.PathLike, cfg) -> Path:
    """Where the calibration of `model_path` with engine config `cfg` on this machine lives."""
    import torch

    from strata.experts.costs import machine_id

    key = "\n".join([machine_id(torch.device(cfg.device)), model_key(model_path),
                     budget_key(cfg.device, cfg.experts.vram_gb, cfg.experts.slots)])
    return calibration_dir() / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def load_calibration(model_path: str | os.PathLike, cfg) -> dict | None:
    """The saved calibration for this machine, model and budget, or None (a damaged file is ignored)."""
    path = calibration_path(model_path, cfg)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            return None
        Setting(**data["setting"])
        return data
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("strata: ignoring calibration %s: %s", path, e)
        return None


def apply_calibration(cfg, calib: dict, explicit: set[str] = frozenset()) -> dict:
    """Set cfg.experts' knobs from a calibration, except those named in `explicit` (ExpertConfig field names
    the user set) or already moved from their defaults. Returns {field: (old, new)} of what changed."""
    from strata.config import ExpertConfig

    s = Setting(**calib["setting"])
    defaults = ExpertConfig()
    ex = cfg.experts
    changed = {}
    for field, value in (("cpu_threads", s.threads), ("cpu_plan", s.cpu_plan), ("cache_policy", s.cache_policy),
                         ("promote_min", s.promote_min), ("swap_budget", s.swap_budget)):
        if field in explicit or getattr(ex, field) != getattr(defaults, field):
            continue
        if getattr(ex, field) != value:
            changed[field] = (getattr(ex, field), value)
            setattr(ex, field, value)
    ex.validate()
    return changed


def save_calibration(path: Path, data: dict) -> None:
    from strata.experts.profile import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"format": FORMAT, "version": VERSION, **data}, indent=1, default=str))
