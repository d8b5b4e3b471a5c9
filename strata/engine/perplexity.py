"""Perplexity and KL divergence over a text file, computed the way llama.cpp's `llama-perplexity` does.

Chunking (so that numbers compare with llama.cpp's on the same GGUF and text):
- the whole text is tokenized once, with a BOS in front when the vocabulary adds one (special-token text in the
  file is not parsed as special tokens);
- it is cut into `len(tokens) // n_ctx` chunks of n_ctx tokens (the tail is dropped), at most --chunks of them;
  each chunk runs from an empty cache, with its first token replaced by BOS when the vocabulary adds one;
- only the second half of each chunk is scored, so that every scored token has at least n_ctx/2 tokens of
  context: with first = n_ctx // 2, the logits at positions first .. n_ctx - 2 predict tokens first + 1 ..
  n_ctx - 1 of the chunk (n_ctx - 1 - first tokens per chunk);
- PPL = exp(mean NLL); its error is PPL * sqrt(var(NLL) / (count - 1)) with var the population variance.

KL divergence: a base run (`--kl-divergence-base FILE` without `--kl-divergence`) writes llama.cpp's logits file,
so files are interchangeable with `llama-perplexity --kl-divergence-base`:
  "_logits_" | n_ctx u32 | n_vocab i32 | n_chunk i32 | tokens i32[n_chunk * n_ctx] (as tokenized, no BOS swap)
  then per chunk, per scored position, nv = 2 * ceil(n_vocab / 2) + 4 uint16 values: the first four hold two
  float32 (scale, min_log_prob), then q[v] with log p[v] ~= scale * q[v] + min_log_prob. Log-probs below
  max - 16 nats (where max is the top logit) are stored as the floor, and count as zero probability in the KL.
A later run with `--kl-divergence` reads the tokens from that file, runs the same chunks and reports the mean
KL(base || this model), its error, and how often both models rank the same token first.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import torch

from strata import StrataError

MAGIC = b"_logits_"
FLOOR_NATS = 16.0  # log-probs this far below the top one are stored as the floor (llama.cpp's choice)


def tokenize(tok, text: str) -> list[int]:
    """The whole text as llama.cpp's perplexity tool tokenizes it: BOS when the vocabulary adds one, no EOS, and
    no special-token parsing."""
    ids = tok.encode(text, add_special=False, parse_special=False)
    return ([tok.bos_id] + ids) if tok.add_bos else ids


def n_chunks_for(n_tokens: int, n_ctx: int, chunks: int = -1) -> int:
    """How many chunks of n_ctx tokens are scored (chunks <= 0: all that fit)."""
    if n_ctx < 4:
        raise StrataError(f"the context (-c) must be at least 4 tokens for perplexity, got {n_ctx}")
    if n_tokens < 2 * n_ctx:
        raise StrataError(f"the text tokenizes to only {n_tokens} tokens: perplexity with a context of {n_ctx} "
                          f"needs at least {2 * n_ctx} (use a longer file or a smaller -c)")
    n = n_tokens // n_ctx
    return min(chunks, n) if chunks > 0 else n


def scored(n_ctx: int) -> tuple[int, int]:
    """(first, n): the logits at chunk positions first .. first + n - 1 are scored against the next token."""
    first = n_ctx // 2
    return first, n_ctx - 1 - first


def chunk_input(tokens: list[int], i: int, n_ctx: int, bos: int | None) -> list[int]:
    """Chunk i as it is run: its first token replaced by BOS when the vocabulary adds one."""
    ids = list(tokens[i * n_ctx:(i + 1) * n_ctx])
    if bos is not None:
        ids[0] = bos
    return ids


@dataclass
class NllStats:
    """Running sums of the scored tokens' negative log-likelihoods."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, v: torch.Tensor) -> None:
        v = v.double()
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += int(v.numel())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_err(self) -> float:
        """llama.cpp's standard error of the PPL: ppl * sqrt(var / (count - 1)), 0 if it cannot be formed."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return self.ppl * math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0


def _mean_err(s: float, s2: float, n: int) -> tuple[float, float]:
    if n < 1:
        return 0.0, 0.0
    m = s / n
    var = s2 / n - m * m
    return m, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


@dataclass
class KlStats:
    test: NllStats = field(default_factory=NllStats)
    base: NllStats = field(default_factory=NllStats)
    kld: float = 0.0
    kld2: float = 0.0
    same_top: int = 0
    count: int = 0
    values: list[torch.Tensor] = field(default_factory=list)  # per-token KL, for the quantiles

    def kl(self) -> tuple[float, float]:
        return _mean_err(self.kld, self.kld2, self.count)

    def same_top_p(self) -> tuple[float, float]:
        p = self.same_top / self.count
        return p, (math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0)


class ChunkRunner:
    """Runs one chunk at a time from an empty cache in slot 0 and returns the scored positions' logits, through
    the engine's model and KV cache (so resident, tiered, CPU and GPU all run as they would serve), in pieces of
    the engine's prefill chunk."""

    def __init__(self, engine):
        self.model, self.kv = engine.model, engine.kv
        self.piece = max(1, int(engine.prefill_chunk))

    @torch.inference_mode()
    def logits(self, ids: list[int], first: int, n: int) -> torch.Tensor:
        """ids: one chunk -> float32 logits [n, V] at positions first .. first + n - 1."""
        from strata.kv.cache import Segment

        m = self.model
        rec = getattr(self.kv, "recurrent", None)
        if rec is not None:  # a recurrent layer's state would carry the previous chunk over
            for d in (rec.conv, rec.ssm):
                for t in d.values():
                    t[0].zero_()
        out = []
        for s in range(0, first + n, self.piece):
            e = min(s + self.piece, first + n)  # the last position (n_ctx - 1) is never needed
            rows = [j - s for j in range(max(s, first), e)]
            t = torch.tensor(ids[s:e], device=m.device)
            pos = torch.arange(s, e, device=m.device)
            if rows:
                out.append(m.forward(t, pos, [Segment(0, s, e - s)], self.kv, rows=rows).float())
            else:  # only context for the scored half: the logits of the last row are computed and dropped
                m.forward(t, pos, [Segment(0, s, e - s)], self.kv)
        return torch.cat(out)


def nll_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


# --- llama.cpp's logits file -------------------------------------------------------------------------------------


def row_width(n_vocab: int) -> int:
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_logprobs(logits: torch.Tensor) -> np.ndarray:
    """float32 logits [R, V] -> uint16 rows [R, nv] in llama.cpp's layout (see the module docstring)."""
    r, v = logits.shape
    x = logits.float()
    mx = x.max(dim=1, keepdim=True).values
    mn = torch.maximum(x.min(dim=1, keepdim=True).values, mx - FLOOR_NATS)
    lse = torch.logsumexp(x - mx, dim=1, keepdim=True)
    scale = (mx - mn) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.where(x > mn, torch.round(inv * (x - mn)), torch.zeros_like(x)).clamp_(0, 65535)
    out = np.zeros((r, row_width(v)), dtype="<u2")
    hdr = torch.cat([scale, mn - mx - lse], dim=1).cpu().numpy().astype("<f4")  # [R, 2] = four uint16 each
    out[:, :4] = hdr.view("<u2")
    out[:, 4:4 + v] = q.to(torch.int32).cpu().numpy()
    return out


def decode_logprobs(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """uint16 rows [R, nv] -> float32 log-probs [R, V]."""
    hdr = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view("<f4").astype(np.float32))  # [R, 2]
    q = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    return hdr[:, :1] * q + hdr[:, 1:2]


def write_header(f: BinaryIO, n_ctx: int, n_vocab: int, n_chunk: int, tokens: list[int]) -> None:
    f.write(MAGIC)
    f.write(struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
    f.write(np.asarray(tokens[:n_chunk * n_ctx], dtype="<i4").tobytes())


def base_file_bytes(n_ctx: int, n_vocab: int, n_chunk: int) -> int:
    """The size of a logits file: header, tokens, then n_chunk chunks of scored rows."""
    return 20 + 4 * n_ctx * n_chunk + n_chunk * 2 * scored(n_ctx)[1] * row_width(n_vocab)


@dataclass
class BaseFile:
    f: BinaryIO
    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: list[int]

    @classmethod
    def open(cls, path: str) -> "BaseFile":
        try:
            f = open(path, "rb")
        except OSError as e:
            raise StrataError(f"cannot read the KL base {path}: {e.strerror}") from None
        head = f.read(20)
        if len(head) < 20 or head[:8] != MAGIC:
            f.close()
            raise StrataError(f"{path} is not a logits file written by --kl-divergence-base")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[8:])
        if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:  # (before any size is computed from them)
            f.close()
            raise StrataError(f"{path}: a damaged logits file (its header says -c {n_ctx}, {n_vocab} tokens, "
                              f"{n_chunk} chunks)")
        # the file's size is known from the header: a cut file is refused now, not chunks of work later
        want = base_file_bytes(n_ctx, n_vocab, n_chunk)
        have = os.fstat(f.fileno()).st_size
        if have < want:
            f.close()
            raise StrataError(f"{path}: a truncated or damaged logits file ({have} bytes; its header's {n_chunk} "
                              f"chunks of -c {n_ctx} over {n_vocab} tokens take {want})")
        raw = f.read(4 * n_ctx * n_chunk)
        toks = np.frombuffer(raw, dtype="<i4").tolist()
        return cls(f, path, n_ctx, n_vocab, n_chunk, toks)

    def chunk_rows(self, i: int) -> np.ndarray:
        _, n = scored(self.n_ctx)
        nv = row_width(self.n_vocab)
        raw = self.f.read(2 * n * nv)
        if len(raw) != 2 * n * nv:
            raise StrataError(f"{self.path}: the log-probs of chunk {i + 1} are missing (a truncated file)")
        return np.frombuffer(raw, dtype="<u2").reshape(n, nv)


def kl_chunk(logits: torch.Tensor, base_rows: np.ndarray, targets: torch.Tensor, st: KlStats) -> None:
    """Adds one chunk's scored positions to st: KL(base || model) per position over the tokens the base gives
    more than the floor, the NLL of both, and whether both rank the same token first."""
    v = logits.shape[1]
    lp = torch.log_softmax(logits.float(), dim=-1)  # on the model's device: [n, V] is large for a real vocabulary
    lb = decode_logprobs(base_rows, v).to(lp.device)
    pb = torch.where(lb > -FLOOR_NATS, lb.exp(), torch.zeros_like(lb))
    kl = (pb * (lb - lp)).sum(dim=1).double()
    t = targets.to(lp.device)[:, None]
    st.test.add(-lp.gather(1, t).squeeze(1))
    st.base.add(-lb.gather(1, t).squeeze(1))
    st.kld += float(kl.sum())
    st.kld2 += float((kl * kl).sum())
    # the model's top token is "the same" when the base ranks it first to the file's precision: two tokens within
    # half a uint16 step of the top both store the top value, and argmax alone would pick one of them at random
    top = lp.argmax(dim=1, keepdim=True)
    st.same_top += int((lb.gather(1, top).squeeze(1) >= lb.max(dim=1).values).sum())
    st.count += int(kl.numel())
    st.values.append(kl.float().cpu())


# --- the runs ----------------------------------------------------------------------------------------------------


def _end_line(out) -> None:
    with contextlib.suppress(OSError, ValueError):  # (a closed or broken stdout: nothing more to say there)
        out.write("\n")
        out.flush()


def run_perplexity(runner: ChunkRunner, tokens: list[int], n_ctx: int, n_chunk: int, bos: int | None,
                   save: BinaryIO | None = None, out=None) -> NllStats:
    """Scores n_chunk chunks, printing `[i]ppl,` after each; with save, writes the base logits file too."""
    out = out or sys.stdout  # (read at the call: a test's capture replaces sys.stdout)
    first, n = scored(n_ctx)
    st = NllStats()
    vocab = None
    try:
        for i in range(n_chunk):
            logits = runner.logits(chunk_input(tokens, i, n_ctx, bos), first, n)
            targets = torch.tensor(tokens[i * n_ctx + first + 1:i * n_ctx + first + 1 + n], device=logits.device)
            st.add(nll_of(logits, targets))
            if save is not None:
                if vocab is None:
                    vocab = logits.shape[1]
                    write_header(save, n_ctx, vocab, n_chunk, tokens)
                save.write(encode_logprobs(logits).tobytes())
            out.write(f"[{i + 1}]{st.ppl:.4f},")
            out.flush()
    finally:  # the scores line ends however the run does: an error or Ctrl-C is said on a line of its own
        _end_line(out)
    return st


def run_kl(runner: ChunkRunner, base: BaseFile, n_chunk: int, bos: int | None, out=None) -> KlStats:
    out = out or sys.stdout
    first, n = scored(base.n_ctx)
    st = KlStats()
    try:
        for i in range(n_chunk):
            rows = base.chunk_rows(i)
            logits = runner.logits(chunk_input(base.tokens, i, base.n_ctx, bos), first, n)
            if logits.shape[1] != base.n_vocab:
                raise StrataError(f"{base.path} holds log-probs over {base.n_vocab} tokens, the model gives "
                                  f"{logits.shape[1]}: a base from another vocabulary")
            s = i * base.n_ctx + first + 1
            kl_chunk(logits, rows, torch.tensor(base.tokens[s:s + n]), st)
            out.write(f"[{i + 1}]{st.kl()[0]:.6f},")
            out.flush()
    finally:
        _end_line(out)
    return st


def kl_report(st: KlStats) -> list[str]:
    def me(s: NllStats):
        return _mean_err(s.nll, s.nll2, s.count)

    lt, lb = me(st.test), me(st.base)
    kl, kle = st.kl()
    p, pe = st.same_top_p()
    vals = torch.cat(st.values)
    q = torch.quantile(vals, torch.tensor([0.5, 0.9, 0.99]))
    return [
        f"Mean PPL(Q)      : {math.exp(lt[0]):10.6f} +/- {math.exp(lt[0]) * lt[1]:10.6f}",
        f"Mean PPL(base)   : {math.exp(lb[0]):10.6f} +/- {math.exp(lb[0]) * lb[1]:10.6f}",
        f"Mean ln(PPL(Q)/PPL(base)): {lt[0] - lb[0]:10.6f}",
        f"Mean KLD         : {kl:10.6f} +/- {kle:10.6f}",
        f"Median KLD       : {float(q[0]):10.6f}",
        f"90.0% KLD        : {float(q[1]):10.6f}",
        f"99.0% KLD        : {float(q[2]):10.6f}",
        f"Maximum KLD      : {float(vals.max()):10.6f}",
        f"Same top p       : {100 * p:7.3f} +/- {100 * pe:6.3f} %",
    ]
