"""The training loop: AdamW, warm-up then cosine decay, bf16 autocast on CUDA, a wall-clock budget.

The schedule is defined by a step count. Without ``steps`` the loop times its first steps and fixes the count
that fits the budget (recorded, so ``--steps N`` replays the same schedule); a hard stop at 115% of the budget
guards against a slower machine. Validation loss is measured on fixed windows of the validation split; the
weights with the best validation loss are the ones kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class TrainArgs:
    batch: int = 16
    ctx: int = 2048
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seconds: float = 180.0
    steps: int | None = None
    calib_steps: tuple[int, int] = (3, 13)  # steps timed to size the schedule
    log_every: int = 10
    evals: int = 20  # validation measurements over the run
    val_windows: int = 16
    seed: int = 0


def lr_at(step: int, total: int, a: TrainArgs) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _loss(model, x, y, dev):
    """The trunk's cross-entropy and aux loss (validation, and training a model without ``train_losses``)."""
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        logits, aux = model(x)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    return ce, aux


@torch.no_grad()
def val_loss(model, val: torch.Tensor, a: TrainArgs, dev) -> float:
    """Mean loss over the first ``val_windows`` non-overlapping windows of the validation stream."""
    n = min(a.val_windows, (len(val) - 1) // a.ctx)
    if n <= 0:
        return float("nan")
    model.eval()
    tot = 0.0
    for i in range(0, n, 8):
        idx = torch.arange(i, min(n, i + 8), device=dev)[:, None] * a.ctx + torch.arange(a.ctx + 1, device=dev)
        b = val[idx].long()
        ce, _ = _loss(model, b[:, :-1], b[:, 1:], dev)
        tot += float(ce) * len(idx)
    model.train()
    return tot / n


def train(model, train_ids: np.ndarray, val_ids: np.ndarray, a: TrainArgs, dev: torch.device, log=print) -> dict:
    """Train ``model`` in place; returns the log (losses over time) and what the run did."""
    torch.manual_seed(a.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)
    data = torch.from_numpy(train_ids.astype(np.int32)).to(dev)
    val = torch.from_numpy(val_ids.astype(np.int32)).to(dev)
    if len(data) <= a.ctx + 1:
        raise ValueError(f"only {len(data)} training tokens for windows of {a.ctx}")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    ar = torch.arange(a.ctx + 1, device=dev)
    coef = model.cfg.aux_loss_coef
    total = a.steps or 10**9
    eval_every = max(1, (a.steps or 0) // a.evals) if a.steps else None
    log_rows, val_rows = [], []
    best = (float("inf"), -1, None)
    t0 = time.perf_counter()
    t_cal = None
    mtp_w = getattr(model.cfg, "mtp_weight", 0.0) if hasattr(model, "train_losses") else 0.0
    acc = acc_aux = acc_mtp = 0.0
    acc_n = 0
    step = 0
    stopped = "steps"
    model.train()
    while step < total:
        if step == a.calib_steps[0]:
            _sync(dev)
            t_cal = time.perf_counter()
        if a.steps is None and step == a.calib_steps[1]:
            _sync(dev)
            per = (time.perf_counter() - t_cal) / (a.calib_steps[1] - a.calib_steps[0])
            left = a.seconds - (time.perf_counter() - t0)
            # leave room for the validation passes (each about a step or two)
            total = max(step + 1, step + int(left / per / 1.03))
            eval_every = max(1, total // a.evals)
            log(f"train: {per * 1e3:.1f} ms/step -> {total} steps in the {a.seconds:.0f} s budget")
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, a)
        starts = torch.randint(0, len(data) - a.ctx - 1, (a.batch,), device=dev, generator=gen)
        b = data[starts[:, None] + ar].long()  # [B, T+1]
        if hasattr(model, "train_losses"):  # (tools/tiny/glm.py: the MTP block's loss, the routers' bias update)
            o = model.train_losses(b[:, :-1], b[:, 1:])
            ce, aux, mtp = o["ce"], o["aux"], o.get("mtp_ce")
        else:
            (ce, aux), mtp, o = _loss(model, b[:, :-1], b[:, 1:], dev), None, None
        if mtp is not None and step >= 0.7 * total:
            mtp_w = getattr(model.cfg, "mtp_weight_late", mtp_w)
        loss = ce + coef * aux + (mtp_w * mtp if mtp is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        if o is not None and hasattr(model, "update_bias"):
            model.update_bias(o["ids"])
        if mtp is not None:
            acc_mtp = acc_mtp + mtp.detach()
        acc, acc_aux, acc_n = acc + ce.detach(), acc_aux + aux.detach(), acc_n + 1
        step += 1
        if step % a.log_every == 0 or step == total:
            row = {"step": step, "tokens": step * a.batch * a.ctx, "seconds": round(time.perf_counter() - t0, 2),
                   "lr": lr_at(step - 1, total, a), "loss": float(acc) / acc_n, "aux": float(acc_aux) / acc_n,
                   "grad_norm": float(gnorm)}
            if mtp is not None:
                row["mtp_loss"] = float(acc_mtp) / acc_n
            log_rows.append(row)
            log(f"step {step}/{total} loss {row['loss']:.4f} aux {row['aux']:.3f} lr {row['lr']:.2e} "
                + (f"mtp {row['mtp_loss']:.4f} " if mtp is not None else "") + f"{row['seconds']:.0f}s")
            acc = acc_aux = acc_mtp = 0.0
            acc_n = 0
        if eval_every and (step % eval_every == 0 or step == total):
            v = val_loss(model, val, a, dev)
            val_rows.append({"step": step, "seconds": round(time.perf_counter() - t0, 2), "val_loss": v})
            log(f"step {step} val_loss {v:.4f}")
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})
        if step < total and time.perf_counter() - t0 > a.seconds * 1.15:
            stopped = "time"
            log(f"train: stopped by the time limit at step {step} of {total}")
            break
    _sync(dev)
    seconds = time.perf_counter() - t0
    if best[2] is not None:
        model.load_state_dict(best[2])
    return {"log": log_rows, "val": val_rows, "steps": step, "planned_steps": total, "stopped_by": stopped,
            "seconds": round(seconds, 1), "tokens_seen": step * a.batch * a.ctx,
            "best_val_loss": best[0], "best_step": best[1], "tokens_per_second": round(step * a.batch * a.ctx / seconds)}
