"""Routing profiles: how often each expert of each MoE layer was routed, saved between runs.

A profile ranks a layer's experts by use, so the expert cache can start warm (`initial_fill`) instead
of learning from an empty pool. It is gathered from live routing (`observe`), from a cache policy's
use counts (`from_policy`) or by merging other profiles, and stored as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Sequence

import numpy as np

from strata import StrataError

FORMAT = "strata-routing-profile"
VERSION = 1


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` so that readers see the old file or the new one, never a part.

    Writes a temporary file in the same directory, fsyncs it, renames it over `path` and fsyncs the
    directory; on any error the temporary file is removed and `path` is left as it was.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms; the rename is done anyway
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class RoutingProfile:
    """Per-layer expert use counts: `counts[layer, expert]` over `tokens` routed steps."""

    def __init__(
        self,
        n_layers: int,
        n_experts: int,
        counts: np.ndarray | Sequence[Sequence[float]] | None = None,
        tokens: int = 0,
        model: str = "",
    ):
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"need at least one layer and one expert, got {n_layers} x {n_experts}")
        self.n_layers = n_layers
        self.n_experts = n_experts
        if counts is None:
            self.counts = np.zeros((n_layers, n_experts), dtype=np.float64)  # [L, E]
        else:
            self.counts = np.array(counts, dtype=np.float64)  # [L, E]
            if self.counts.shape != (n_layers, n_experts):
                raise ValueError(f"counts have shape {self.counts.shape}, want ({n_layers}, {n_experts})")
            if not np.all(np.isfinite(self.counts)) or np.any(self.counts < 0):
                raise ValueError("counts must be finite and >= 0")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self.tokens = int(tokens)
        self.model = model

    # --- gathering -------------------------------------------------------------------------

    def observe(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Count one routing of `layer` (call `add_tokens` once per step for the frequencies)."""
        ids = np.asarray(expert_ids, dtype=np.int64)  # [n]
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_experts):
            raise ValueError(f"expert ids must be within 0..{self.n_experts - 1}")
        np.add.at(self.counts[layer], ids, 1.0)

    def add_tokens(self, n: int = 1) -> None:
        self.tokens += n

    def merge(self, other: RoutingProfile) -> RoutingProfile:
        """A new profile with both profiles' counts and tokens."""
        self._check_shape(other.n_layers, other.n_experts, what="the profile being merged")
        return RoutingProfile(
            self.n_layers,
            self.n_experts,
            self.counts + other.counts,
            self.tokens + other.tokens,
            self.model or other.model,
        )

    @classmethod
    def from_policy(cls, policy, model: str = "") -> RoutingProfile:
        """The raw use counts a cache policy gathered, one token per policy step."""
        return cls(policy.n_layers, policy.n_experts, policy.usage(), tokens=policy.steps, model=model)

    # --- reading ---------------------------------------------------------------------------

    def ranking(self, layer: int) -> list[int]:
        """The layer's experts, most used first (ties: lower id first)."""
        return np.lexsort((np.arange(self.n_experts), -self.counts[layer])).tolist()

    def rankings(self) -> dict[int, list[int]]:
        return {layer: self.ranking(layer) for layer in range(self.n_layers)}

    def frequency(self, layer: int) -> np.ndarray:
        """[E] uses per token of the layer's experts (zeros before any token)."""
        return self.counts[layer] / self.tokens if self.tokens else np.zeros(self.n_experts)

    def frequencies(self) -> dict[int, np.ndarray]:
        return {layer: self.frequency(layer) for layer in range(self.n_layers)}

    # --- files -----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "tokens": self.tokens,
            # integers stay integers in the file, decayed counts keep their fraction
            "counts": [[int(c) if float(c).is_integer() else float(c) for c in row] for row in self.counts],
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile atomically: a failed save leaves the previous file intact."""
        atomic_write_text(path, json.dumps(self.to_dict(), separators=(",", ":")))

    @classmethod
    def load(
        cls, path: str | os.PathLike, n_layers: int | None = None, n_experts: int | None = None
    ) -> RoutingProfile:
        """Read a saved profile; with n_layers / n_experts, check it fits the model."""
        path = pathlib.Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise StrataError(f"routing profile not found: {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StrataError(f"routing profile {path} is unreadable: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise StrataError(f"{path} is not a strata routing profile")
        if data.get("version") != VERSION:
            raise StrataError(f"routing profile {path} has version {data.get('version')}, this strata reads {VERSION}")
        try:
            prof = cls(
                int(data["n_layers"]),
                int(data["n_experts"]),
                data["counts"],
                tokens=int(data["tokens"]),
                model=str(data.get("model", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StrataError(f"routing profile {path} is malformed: {e}") from None
        if n_layers is not None or n_experts is not None:
            prof._check_shape(
                prof.n_layers if n_layers is None else n_layers,
                prof.n_experts if n_experts is None else n_experts,
                what="the model",
                path=path,
            )
        return prof

    def _check_shape(self, n_layers: int, n_experts: int, what: str, path: os.PathLike | None = None) -> None:
        if (n_layers, n_experts) != (self.n_layers, self.n_experts):
            name = f"routing profile {path}" if path is not None else "routing profile"
            raise StrataError(
                f"{name} has {self.n_layers} layers x {self.n_experts} experts, "
                f"{what} has {n_layers} x {n_experts}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingProfile):
            return NotImplemented
        return (
            (self.n_layers, self.n_experts, self.tokens, self.model)
            == (other.n_layers, other.n_experts, other.tokens, other.model)
            and bool(np.array_equal(self.counts, other.counts))
        )

    def __repr__(self) -> str:
        return f"RoutingProfile({self.n_layers} layers x {self.n_experts} experts, {self.tokens} tokens)"


def warm_policy(policy, profile: RoutingProfile) -> None:
    """Fill a cache policy from a profile: top-ranked experts resident, scores seeded by frequency."""
    profile._check_shape(policy.n_layers, policy.n_experts, what="the cache policy")
    policy.initial_fill(profile.rankings(), profile.frequencies() if profile.tokens else None)



def layer_slots(counts: np.ndarray, budget_bytes: int, slot_bytes: Sequence[int]) -> list[int]:
    """Cache slots per layer (`--cache-layout profile`) that cover the most routed experts a profile predicts.

    counts [L, E]: a routing profile's use counts; slot_bytes [L]: one expert's bytes in each layer (Q4_K_M files
    mix Q4_K and Q6_K layers). Each layer's experts are taken hottest first; across layers, the next slot goes to
    the expert with the highest share of its layer's routing per byte, until `budget_bytes` is spent. Taking the
    globally best ratios keeps every layer's choice a prefix of its ranking, so this maximises the expected hits
    (for a static cache filled from the profile) among layouts of that many bytes.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"counts must be [layers, experts], got shape {c.shape}")
    L, E = c.shape
    sb = np.asarray(slot_bytes, dtype=np.float64)
    if sb.shape != (L,) or np.any(sb <= 0):
        raise ValueError("slot_bytes needs one positive size per layer")
    tot = c.sum(1, keepdims=True)
    share = np.where(tot > 0, c / np.where(tot > 0, tot, 1), 1.0 / E)  # an unseen layer: uniform
    vals = -np.sort(-share, axis=1) / sb[:, None]  # [L, E] per layer, hottest first, per byte
    order = np.argsort(-vals.reshape(-1), kind="stable")
    cost = np.repeat(sb, E)[order]
    n = int(np.searchsorted(np.cumsum(cost), budget_bytes, side="right"))
    return np.bincount(order[:n] // E, minlength=L).astype(int).tolist()
