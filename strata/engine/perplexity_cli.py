"""`strata perplexity`: llama-perplexity's PPL and KL-divergence runs (strata.engine.perplexity has the math).

Scores go to stdout (`[1]12.3456,[2]...` then `Final estimate: PPL = x +/- y`), loading and timing to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

from strata import StrataError

DEFAULT_PPL_CTX = 512  # llama-perplexity's customary context; -c sets another


def _model_meta(path: str):
    """(tokenizer, trained context, vocabulary size) from the GGUF's metadata, before any weight is loaded."""
    from strata.gguf.reader import open_gguf
    from strata.gguf.tokenizer import Tokenizer
    from strata.models.registry import family_for

    g = open_gguf(path)
    args = family_for(g.arch).load_args(g)
    if "tokenizer.ggml.model" not in g.metadata:
        raise StrataError(f"{path}: the model has no tokenizer in its metadata")
    return Tokenizer.from_metadata(g.metadata), int(args.ctx_len), int(args.vocab_size)


def _read_text(path: str) -> str:
    """The file as llama-perplexity reads its -f: the bytes as they are (no newline translation: a CRLF file keeps
    its carriage returns, which are tokens), less one trailing newline, and each byte that is not part of a valid
    UTF-8 character read as one U+FFFD, as llama.cpp's tokenizer reads it. Decoded otherwise, the same file would
    be another token stream, and another PPL."""
    from strata.text import replace_surrogates

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror}") from None
    if data.endswith(b"\n"):
        data = data[:-1]
    return replace_surrogates(data.decode("utf-8", errors="surrogateescape"))


def _check_base_path(path: str) -> None:
    """The base file to write: checked before the model loads, so a bad path costs no computation."""
    p = Path(path)
    if p.is_dir():
        raise StrataError(f"--kl-divergence-base {path} is a directory: give a file to save the base log-probs to")
    parent = p.parent
    if not parent.exists():
        raise StrataError(f"cannot write {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise StrataError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise StrataError(f"cannot write {path}: no permission to create files in {parent}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _check_base_room(path: str, nbytes: int, n_chunk: int) -> None:
    """The base file's size is known before the first chunk runs (a real vocabulary's log-probs take tens of GB
    over a long text): a disk without room for it fails now, not hours into the run."""
    parent = Path(path).parent
    free = shutil.disk_usage(parent).free
    if nbytes > free:
        raise StrataError(f"not enough free disk for {path}: the log-probs of {n_chunk} chunks take {_gb(nbytes)}, "
                          f"{parent} has {_gb(free)} free (--chunks N saves fewer)")


def _check_not_an_input(path: str, inputs) -> None:
    """The base file replaces what is at its path: never the text or the model the run reads (a mistyped flag
    would turn the text into a logits file)."""
    p = Path(path)
    for what, other in inputs:
        if other and p.exists() and Path(other).exists() and os.path.samefile(p, other):
            raise StrataError(f"--kl-divergence-base {path} is {what} of this run: it would be overwritten with the "
                              "log-probs (give another file)")


def cmd_perplexity(args) -> int:
    from strata.engine import perplexity as P
    from strata.engine.cli import engine_config, load_from_args, resolve_model_path
    from strata.engine.engine import Engine

    kl = args.kl_divergence
    if kl and not args.kl_divergence_base:
        raise StrataError("--kl-divergence needs --kl-divergence-base FILE: the logits of a base run")
    if not kl and not args.file:
        raise StrataError("-f/--file is required: the text to score")
    if args.chunks == 0 or args.chunks < -1:
        raise StrataError(f"--chunks must be a positive number of chunks (or -1: all), got {args.chunks}")
    if args.kl_divergence_base and not kl:
        _check_base_path(args.kl_divergence_base)
    engine_config(args)  # bad engine flags fail here, before anything loads
    path = resolve_model_path(args.model)
    if args.kl_divergence_base and not kl:
        _check_not_an_input(args.kl_divergence_base, (("-f", args.file), ("the model", path)))
    tok, ctx_len, vocab = _model_meta(path)
    bos = tok.bos_id if tok.add_bos else None

    base = None
    if kl:
        base = P.BaseFile.open(args.kl_divergence_base)
        if args.ctx_size is not None and (args.ctx_size or ctx_len) != base.n_ctx:
            asked = args.ctx_size or f"0 (the model's context, {ctx_len})"
            raise StrataError(f"{base.path} was computed with -c {base.n_ctx}, not {asked}: the chunks "
                              "must be the same (leave -c out to use the file's)")
        n_ctx = base.n_ctx
        if base.n_vocab != vocab:
            raise StrataError(f"{base.path} holds log-probs over {base.n_vocab} tokens, {path} has a vocabulary "
                              f"of {vocab}: a base from another model family")
        if max(base.tokens) >= vocab or min(base.tokens) < 0:
            raise StrataError(f"{base.path}: its tokens are not of this model's vocabulary")
        if args.file and P.tokenize(tok, _read_text(args.file))[:len(base.tokens)] != base.tokens:
            raise StrataError(f"{args.file} does not tokenize to the tokens in {base.path}: another text or "
                              "another tokenizer")
        tokens = base.tokens
        if n_ctx > ctx_len:  # (the -c is the file's, not one typed)
            raise StrataError(f"{base.path} was computed with -c {n_ctx}, larger than {path}'s context of "
                              f"{ctx_len}: a base from another model")
    else:
        # -c 0 is the model's own context, as llama-perplexity reads it; no -c, the customary 512
        n_ctx = min(DEFAULT_PPL_CTX, ctx_len) if args.ctx_size is None else args.ctx_size or ctx_len
        tokens = P.tokenize(tok, _read_text(args.file))
    if n_ctx > ctx_len:
        raise StrataError(f"-c {n_ctx} is larger than the model's context of {ctx_len}")
    if base is not None:  # the base run already checked the text's length; it may hold a single chunk
        n_chunk = min(args.chunks, base.n_chunk) if args.chunks > 0 else base.n_chunk
    else:
        n_chunk = P.n_chunks_for(len(tokens), n_ctx, args.chunks)

    if args.kl_divergence_base and not kl:
        _check_base_room(args.kl_divergence_base, P.base_file_bytes(n_ctx, vocab, n_chunk), n_chunk)

    args.ctx_size = n_ctx  # the KV cache holds one chunk
    lm = load_from_args(args)
    engine = Engine(lm, n_slots=1)
    if engine.vram_split is not None:
        print(f"strata: {engine.vram_split.render()}", file=sys.stderr)
    runner = P.ChunkRunner(engine)
    first, n = P.scored(n_ctx)
    print(f"strata: perplexity over {n_chunk} chunks of {n_ctx} tokens ({len(tokens)} tokens in all), "
          f"scoring {n} tokens per chunk, {runner.piece} tokens per forward", file=sys.stderr)
    t0 = time.perf_counter()
    if base is not None:
        try:
            st = P.run_kl(runner, base, n_chunk, bos)
        finally:
            base.f.close()
        for line in P.kl_report(st):
            print(line)
    elif args.kl_divergence_base:
        from strata.gguf.writer import claim_temp

        tmp = None  # written beside the base under a name of this run's own, renamed when whole
        try:
            tmp = claim_temp(Path(args.kl_divergence_base))
            with open(tmp, "wb") as f:
                st = P.run_perplexity(runner, tokens, n_ctx, n_chunk, bos, save=f)
            os.replace(tmp, args.kl_divergence_base)
        except BaseException as e:  # a failed write, an error, Ctrl-C: no half-written file is left
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if isinstance(e, OSError):  # (a short write carries no errno: then most likely a full disk)
                why = e.strerror or f"{e}: a short write (is the disk full?)"
                raise StrataError(f"cannot write {args.kl_divergence_base}: {why}") from None
            raise
        print(f"Final estimate: PPL = {st.ppl:.4f} +/- {st.ppl_err:.5f}")
        print(f"strata: saved the base log-probs to {args.kl_divergence_base}", file=sys.stderr)
    else:
        st = P.run_perplexity(runner, tokens, n_ctx, n_chunk, bos)
        print(f"Final estimate: PPL = {st.ppl:.4f} +/- {st.ppl_err:.5f}")
    dt = time.perf_counter() - t0
    print(f"strata: {n_chunk} chunks in {dt:.1f}s ({n_chunk * n_ctx / max(dt, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0


def register(sub) -> None:
    from strata.engine.cli import add_engine_args

    p = sub.add_parser("perplexity", help="perplexity of a text file, or KL divergence against a base run, as "
                       "llama.cpp's llama-perplexity computes them",
                       description="Perplexity over a text, in chunks of -c tokens (default "
                       f"{DEFAULT_PPL_CTX}; -c 0: the model's context) of which the second half is scored, as llama-perplexity "
                       "does. "
                       "--kl-divergence-base FILE saves the run's log-probs (llama.cpp's file format); adding "
                       "--kl-divergence compares this model against them.")
    add_engine_args(p)
    p.add_argument("-f", "--file", default=None, help="the text file to score")
    # llama-perplexity's command lines carry -b (its batch, which changes no score): here, tokens per forward
    p.add_argument("-b", "--batch-size", dest="prefill_chunk", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="as llama-perplexity's -b: the tokens of a chunk run per forward (= --prefill-chunk N)")
    p.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks (-1: all)")
    p.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                   help="write the log-probs of this run to FILE (with --kl-divergence: read them from it)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="KL divergence of this model from the base run in --kl-divergence-base")
    p.set_defaults(func=cmd_perplexity, ctx_size=None)  # (None: no -c given, told apart from -c 0)
