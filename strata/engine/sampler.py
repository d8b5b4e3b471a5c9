"""Token sampling on the model's device: penalties -> temperature -> top-k -> top-p -> min-p -> draw.

Everything stays on the device, and nothing here reads a tensor value back to the host. The draw uses the
sequence's own generator, seeded for each draw from the request's seed and the position of the token being drawn
(`position_seed`): a token's randomness depends on where it stands, never on how many draws came before it, so
the same seed gives the same text whether the tokens came one a step, a verified draft at a time (the rejected
rows' draws do not shift the later ones), or one step ahead.
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


def position_seed(seed: int, pos: int) -> int:
    """The generator's seed for the token at sequence position `pos` of a request seeded `seed` (splitmix64 of
    the pair, so nearby positions and seeds give unrelated streams); below 2**63, as torch's generators take."""
    z = (seed * 0x9E3779B97F4A7C15 + pos + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


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
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [V] -> a 0-d int64 tensor (on the logits' device)."""
    logits = logits.float()
    if recent is not None:
        logits = apply_penalties(logits, recent, p)
    if p.greedy:
        return logits.argmax()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        cum = sp.cumsum(0)
        drop = (cum - sp) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(0, si, sp.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < probs.max() * p.min_p, 0.0)
    return torch.multinomial(probs, 1, generator=generator)[0]


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
