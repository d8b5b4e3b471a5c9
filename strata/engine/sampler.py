"""Token sampling on the model's device: penalties -> temperature -> top-k -> top-p -> min-p -> draw.

Everything stays on the device, and nothing here reads a tensor value back to the host. The draw inverts the
kept distribution's cumulative sum at a uniform number u that is a hash of the request's seed and the position of
the token being drawn (`position_uniform`, and `position_uniform_t` computing the same bits on the device): a
token's randomness depends on where it stands, never on how many draws came before it, so the same seed gives the
same text whether the tokens came one a step, a verified draft at a time (the rejected rows' draws do not shift the
later ones), one step ahead, or drawn inside a captured graph (strata.engine.spec_device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this, sampling is argmax anyway, and dividing float32 logits by the temperature may overflow to inf (then
# softmax gives NaN and the draw raises): a request asking for 5e-324 is served greedily.
MIN_TEMPERATURE = 1e-5
# The same overflow through the repetition penalty (logits / penalty): smaller ones are refused.
MIN_REPETITION_PENALTY = 1e-3


_MASK64 = (1 << 64) - 1


_C = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _splitmix(seed: int, pos: int) -> int:
    """splitmix64 of the pair (seed, position): nearby positions and seeds give unrelated bits."""
    z = (seed * _C[0] + pos + 1) & _MASK64
    z = ((z ^ (z >> 30)) * _C[1]) & _MASK64
    z = ((z ^ (z >> 27)) * _C[2]) & _MASK64
    return z ^ (z >> 31)


def position_uniform(seed: int, pos: int) -> float:
    """The uniform number in [0, 1) that draws the token at sequence position `pos` of a request seeded `seed`:
    the top 53 bits of the pair's splitmix64 (exact in a float64)."""
    return (_splitmix(seed, pos) >> 11) * 2.0 ** -53


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def position_uniform_t(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """position_uniform on the device: seed and pos int64 tensors (broadcast) -> float64 of the same bits (int64
    products wrap as the host's arithmetic mod 2**64 does)."""
    z = seed * _i64(_C[0]) + pos + 1
    z = (z ^ _shr(z, 30)) * _i64(_C[1])
    z = (z ^ _shr(z, 27)) * _i64(_C[2])
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * 2.0 ** -53


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0  # llama.cpp's repeat_penalty over the last `penalty_last_n` tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> None:
        from strata import StrataError

        import math

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise StrataError(f"sampling: {name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0 or not (0.0 < self.top_p <= 1.0) or not (0.0 <= self.min_p <= 1.0) or self.top_k < 0:
            raise StrataError("sampling: need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1, top_k >= 0")
        if not self.repetition_penalty >= MIN_REPETITION_PENALTY:
            raise StrataError(f"sampling: repetition_penalty must be >= {MIN_REPETITION_PENALTY}")


def apply_penalties(logits: torch.Tensor, recent: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] float32; recent [n] int64 token ids (the penalty window) on the same device."""
    if recent.numel() == 0 or (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty):
        return logits
    counts = torch.zeros_like(logits).scatter_add_(0, recent, torch.ones_like(recent, dtype=logits.dtype))
    seen = counts > 0
    if p.repetition_penalty != 1.0:
        pen = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, pen, logits)
    return logits - counts * p.frequency_penalty - seen.to(logits.dtype) * p.presence_penalty


def sample(logits: torch.Tensor, p: SamplingParams, recent: torch.Tensor | None = None,
           generator: torch.Generator | None = None, u: float | None = None) -> torch.Tensor:
    """logits [V] -> a 0-d int64 tensor (on the logits' device). u: the draw's uniform number (position_uniform);
    without it one is taken from `generator`."""
    logits = logits.float()
    if recent is not None:
        logits = apply_penalties(logits, recent, p)
    if p.greedy:
        return logits.argmax()
    if u is not None:  # (a fill, not a copy from the host: no wait for the device)
        ut = torch.full((1,), u, dtype=torch.float64, device=logits.device)
    else:
        ut = torch.rand(1, generator=generator, dtype=torch.float64).to(logits.device)
    return sample_rows(logits[None], p, ut)[0]


def sample_rows(logits: torch.Tensor, p: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """Sampled rows without penalties: logits [T, V], u [T] float64 uniform numbers -> [T] int64. Temperature, then
    top-k, top-p and min-p keep tokens; the draw is the first kept token, most likely first, whose cumulative mass
    passes u times the kept total (a token with no mass is never drawn). With top-k only its k candidates are sorted
    and summed, not the vocabulary. A row is computed as it would be alone."""
    logits = logits.float() / p.temperature
    V = logits.shape[-1]
    if p.top_k and p.top_k < V:
        vals, idx = torch.topk(logits, p.top_k, dim=-1)  # (sorted, most likely first)
    else:
        vals, idx = logits.sort(dim=-1, descending=True)
    probs = torch.softmax(vals, dim=-1)
    if p.top_p < 1.0:
        drop = (probs.cumsum(-1) - probs) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < probs[:, :1] * p.min_p, 0.0)
    cdf = probs.to(torch.float64).cumsum(-1)
    x = u.view(-1, 1).to(torch.float64) * cdf[:, -1:]
    j = torch.searchsorted(cdf, x, right=True).clamp_(max=vals.shape[-1] - 1)
    return idx.gather(-1, j).view(-1)


def token_logprobs(rows: list[torch.Tensor], toks: list[torch.Tensor], ks: list[int]) -> list[torch.Tensor]:
    """Log-probabilities of drawn tokens, for the sequences that asked for them: the log-softmax of the model's raw
    logits (before penalties, logit_bias, a grammar's mask and temperature, as OpenAI reports them), the drawn
    token's and the `k` most likely. Returns one float32 tensor per row on the device: [lp(tok), top values (k),
    top ids (k)] (ids below 2**24 are exact in float32), so the caller reads them all back at once."""
    out = []
    for row, tok, k in zip(rows, toks, ks):
        lp = torch.log_softmax(row.float(), dim=-1)
        parts = [lp.gather(0, tok.view(1).long())]
        if k:
            top = torch.topk(lp, min(k, lp.shape[-1]))
            parts += [top.values, top.indices.float()]
        out.append(torch.cat(parts))
    return out
