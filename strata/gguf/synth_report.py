"""The routing report of `strata synth`: how a model routes a sample text (expert popularity, distinct experts per
batch, reuse from token to token), measured with strata's own forward."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from strata import StrataError

if TYPE_CHECKING:
    import torch

# ---- routing report -----------------------------------------------------------------------------------------

REPORT_CPU_MAX_BYTES = 2 << 30  # on a CPU, larger models take minutes to run 640 tokens: skip the report
FRACTIONS = (0.01, 0.05, 0.10, 0.25, 0.50)


def sample_text() -> tuple[str, str]:
    """(name, text): English prose and Python code from the standard library (textwrap.py)."""
    import textwrap

    path = Path(textwrap.__file__)
    return path.name, path.read_text(encoding="utf-8")


def routing_stats(ids: dict[int, "torch.Tensor"], n_experts: int, batch: int = 512) -> dict:
    """Popularity and diversity of routing from the top-k ids of each MoE layer ({layer: [N, k]})."""
    import torch

    layers = sorted(ids)
    share, curve = [], []
    for layer in layers:
        c = torch.bincount(ids[layer].reshape(-1), minlength=n_experts).sort(descending=True).values.double()
        cum = c.cumsum(0) / c.sum()  # [E]: share of picks taken by the most popular 1, 2, ... experts
        share.append([cum[max(1, round(f * n_experts)) - 1].item() for f in FRACTIONS])
        curve.append([cum[max(1, round(q * n_experts / 10)) - 1].item() for q in range(1, 11)])
    picks = {}
    for layer in dict.fromkeys([layers[0], layers[len(layers) // 2], layers[-1]]):
        x = ids[layer][:batch]  # [n, k]
        n, k = x.shape
        _, counts = torch.unique(x.sort(-1).values, dim=0, return_counts=True)
        same = (counts * (counts - 1) // 2).sum().item()
        reuse = (x[1:, :, None] == x[:-1, None, :]).any(-1).float().mean().item() if n > 1 else 0.0
        picks[layer] = {"tokens": n, "distinct": int(x.unique().numel()),
                        "pairs_differ": 1.0 - same / max(1, n * (n - 1) // 2), "reuse_prev": reuse}
    return {"n_experts": n_experts, "k": int(ids[layers[0]].shape[1]), "n_layers": len(layers),
            "n_tokens": int(ids[layers[0]].shape[0]),
            "share": [sum(s[i] for s in share) / len(share) for i in range(len(FRACTIONS))],
            "curve": [sum(c[i] for c in curve) / len(curve) for i in range(10)], "layers": picks}


def capture_routing(lm, tokens: list[int]) -> dict[int, "torch.Tensor"]:
    """Run strata's model on one prompt and return each MoE layer's top-k expert ids ({layer: [N, k]})."""
    import torch

    from strata.kv.cache import Segment

    m = lm.model
    if m.experts is None:
        raise StrataError("the model has no MoE layers")
    got: dict[int, torch.Tensor] = {}

    def tap(layer, ids):
        got[layer] = ids.detach().to("cpu")

    with torch.inference_mode(), m.tap_routing(tap):
        kv = m.new_kv_cache(1, len(tokens))
        t = torch.tensor(tokens, device=m.device)
        m.forward(t, torch.arange(len(tokens), device=m.device), [Segment(0, 0, len(tokens))], kv)
    return got


def routing_report(path: str | Path, n_tokens: int = 640, batch: int = 512, device: str | None = None) -> dict:
    """Load the model with strata, run the sample text, and return `routing_stats` (plus the text's name)."""
    from strata.config import EngineConfig
    from strata.engine.loader import load_model

    cfg = EngineConfig(model=str(path), ctx_size=n_tokens)
    if device:
        cfg.device = device
    lm = load_model(str(path), cfg)
    name, text = sample_text()
    tokens = lm.tokenizer.encode(text)[:n_tokens]
    stats = routing_stats(capture_routing(lm, tokens), lm.args.n_experts, batch)
    stats["text"] = name
    return stats


def format_report(s: dict) -> str:
    E, k = s["n_experts"], s["k"]
    pct = " | ".join(f"top {f:.0%} {v:5.1%}" for f, v in zip(FRACTIONS, s["share"]))
    lines = [f"routing over {s['n_tokens']} tokens of {s.get('text', 'text')}, {s['n_layers']} MoE layers, "
             f"{E} experts, top-{k}:",
             "  share of picks taken by the most popular experts (mean over layers; uniform routing: the same %):",
             f"    {pct}",
             "  cumulative share of picks by the most popular experts (+ = uniform routing):"]
    for i, v in enumerate(s["curve"]):
        cells = ["#" if j < round(v * 40) else " " for j in range(40)]
        uni = round((i + 1) / 10 * 40) - 1
        cells[uni] = "+"
        lines.append(f"    top {(i + 1) * 10:3d}% [{''.join(cells)}] {v:5.1%}")
    for layer, d in s["layers"].items():
        lines.append(f"  layer {layer:3d}, {d['tokens']}-token batch: {d['distinct']}/{E} experts used, top-{k} sets "
                     f"differ for {d['pairs_differ']:.1%} of token pairs, {d['reuse_prev']:.1%} of picks reused "
                     f"from the previous token")
    return "\n".join(lines)
