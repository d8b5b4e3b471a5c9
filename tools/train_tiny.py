#!/usr/bin/env python3
"""Train strata-tiny, strata's embedded default model, from text found on this machine, in a few minutes.

    PYTHONPATH=$PWD python3 tools/train_tiny.py --out OUT [--minutes 6.5] [--toy] [--family glm4moe]

A GLM-4.5-family model (``--family glm4moe``, the default: 8 layers, hidden 384, 32 experts top-4 of 96 plus a
shared expert, sigmoid routing, tied embeddings, and one multi-token-prediction block trained jointly as a draft
head; ~40 M parameters), or the first version's Qwen3-MoE family (``--family qwen3moe``, no MTP block), learns
Python from the standard library and a few permissively licensed packages installed here, with a
byte-level BPE of 8192 tokens trained on the same text. It is exported through strata's own converter (q8_0
GGUF with the tokenizer and Qwen3's chat template), then measured by strata itself on a held-out slice of the
standard library (perplexity, routing, greedy completions) so that CI can check the same numbers.

Writes to OUT: strata-tiny.gguf (or strata-tiny.gguf.partN pieces of at most --part-mb), strata-tiny.json (the
recorded numbers), train_log.json, manifest.json (every source file with its sha256 and split) and
strata-tiny-heldout.txt (the held-out slice). ``tools/tiny/install.py OUT`` puts them in place in the repository.
See docs/strata-tiny.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()
MAX_GGUF_BYTES = 48_000_000  # what the package may ship (tests/test_strata_tiny.py checks it)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--minutes", type=float, default=6.5, help="training time budget (the loop's wall clock)")
    p.add_argument("--steps", type=int, default=None, help="fixed step count (replays a recorded schedule)")
    p.add_argument("--toy", action="store_true", help="tiny dimensions and data: an end-to-end check on a CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    g = p.add_argument_group("model")
    g.add_argument("--family", default="glm4moe", choices=["glm4moe", "qwen3moe"],
                   help="glm4moe (with an MTP block) or qwen3moe (the first version's family)")
    g.add_argument("--mtp-weight", type=float, default=0.3, help="weight of the MTP block's loss (glm4moe)")
    g.add_argument("--mtp-weight-late", type=float, default=0.1,
                   help="the MTP loss's weight over the last 30%% of the steps (DeepSeek-V3: 0.3, then 0.1)")
    g.add_argument("--bias-rate", type=float, default=1e-3,
                   help="aux-loss-free balancing: the routers' correction-bias step per batch (glm4moe)")
    g.add_argument("--aux", type=float, default=None, help="balance loss coefficient (default: the family's)")
    g.add_argument("--vocab", type=int, default=None)
    g.add_argument("--hidden", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--experts", type=int, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--expert-ffn", type=int, default=None)
    g.add_argument("--ctx", type=int, default=None, help="training window = context length = eval window")
    g = p.add_argument_group("training")
    g.add_argument("--batch", type=int, default=None)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup", type=int, default=None)
    g.add_argument("--min-lr", type=float, default=0.1, help="the cosine's end, as a fraction of --lr")
    g = p.add_argument_group("data and output")
    g.add_argument("--extras", default=None, help="comma-separated packages from tools/tiny/data.py's EXTRA_PACKAGES "
                   "(default: all of them that are installed; 'none' for the standard library only)")
    g.add_argument("--extra-mb", type=float, default=None, help="total text taken from the extra packages")
    g.add_argument("--package-mb", type=float, default=None, help="text taken from each extra package at most")
    g.add_argument("--tok-sample-mb", type=float, default=None, help="text the tokenizer is trained on")
    g.add_argument("--heldout-kb", type=float, default=None, help="size of the shipped held-out slice")
    g.add_argument("--type", default="q8_0", choices=["q8_0", "f16", "bf16", "f32"], help="GGUF weight type")
    g.add_argument("--part-mb", type=float, default=15.0, help="split the GGUF into pieces of at most this size")
    g.add_argument("--no-hf-check", action="store_true", help="skip transformers' perplexity of the checkpoint")
    g.add_argument("--mtp-eval-s", type=float, default=60.0, help="no MTP decoding run of the evaluation starts "
                   "after this many seconds of it (the command's time limit)")
    g.add_argument("--speed", action="store_true", help="measure decode speed with and without MTP drafts in a "
                   "--toy run too (always in a full run)")
    return p.parse_args(argv)


def settings(a) -> tuple[dict, dict]:
    """(model dims, run settings) for a full or --toy run, with command-line overrides."""
    from tools.tiny.evaluate import N_PREDICT

    if a.toy:
        m = dict(vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                 expert_ffn=32, ctx=128)
        r = dict(batch=4, warmup=5, extras=(), extra_mb=0.0, package_mb=0.0, tok_sample_mb=0.3, heldout_kb=4.0, stdlib_limit=60,
                 calib=(2, 5), log_every=2, evals=4, val_windows=4, n_predict=8)
    else:
        m = dict(vocab_size=8192, hidden=384, layers=8, heads=6, kv_heads=2, head_dim=64, experts=32, top_k=4,
                 expert_ffn=96, ctx=2048)
        # the second version's data: up to 24 MB from each package, 160 MB in all (the first run took 8 and 48,
        # and saw its 19.5 M tokens 2.5 times); the tokenizer still learns from the first run's files only
        r = dict(batch=16, warmup=200, extras=None, extra_mb=160.0, package_mb=24.0, tok_sample_mb=8.0, heldout_kb=32.0,
                 stdlib_limit=None, calib=(3, 13), log_every=10, evals=20, val_windows=16, n_predict=N_PREDICT)
    for k, key in (("vocab", "vocab_size"), ("hidden", "hidden"), ("layers", "layers"), ("heads", "heads"),
                   ("kv_heads", "kv_heads"), ("experts", "experts"), ("top_k", "top_k"),
                   ("expert_ffn", "expert_ffn"), ("ctx", "ctx")):
        if getattr(a, k) is not None:
            m[key] = getattr(a, k)
    for k in ("batch", "warmup", "extra_mb", "package_mb", "tok_sample_mb", "heldout_kb"):
        if getattr(a, k) is not None:
            r[k] = getattr(a, k)
    if a.extras is not None:
        r["extras"] = () if a.extras == "none" else tuple(x for x in a.extras.split(",") if x)
    return m, r


def compact_json(d: dict) -> str:
    """``d`` as JSON with one line per item of its top-level lists (the manifest: some 10,000 files)."""
    parts = []
    for k, v in d.items():
        if isinstance(v, list):
            body = ",\n".join("  " + json.dumps(x, separators=(",", ":")) for x in v)
            parts.append(f"{json.dumps(k)}: [\n{body}\n ]")
        else:
            parts.append(f"{json.dumps(k)}: {json.dumps(v, indent=1)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def split_file(path: Path, out_dir: Path, part_bytes: int) -> list[dict]:
    """Copy ``path`` into ``out_dir`` whole, or as ``NAME.partN`` pieces of at most ``part_bytes``."""
    size = path.stat().st_size
    if size <= part_bytes:
        dst = out_dir / path.name
        dst.write_bytes(path.read_bytes())
        return [{"file": dst.name, "bytes": size, "sha256": sha256_file(dst)}]
    parts = []
    with open(path, "rb") as f:
        for i in range((size + part_bytes - 1) // part_bytes):
            dst = out_dir / f"{path.name}.part{i}"
            dst.write_bytes(f.read(part_bytes))
            parts.append({"file": dst.name, "bytes": dst.stat().st_size, "sha256": sha256_file(dst)})
    return parts


def main(argv=None) -> int:
    a = parse_args(argv)
    import numpy as np
    import torch

    from tools.tiny import data as D
    from tools.tiny.evaluate import fill_strata_numbers, hf_perplexity, module_mtp_accuracy, module_perplexity
    from tools.tiny.model import TinyConfig, TinyMoE, save_hf_checkpoint
    from tools.tiny.train import TrainArgs, train

    mdims, run = settings(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="strata-tiny-"))
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    random.seed(a.seed)
    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    stages: dict[str, float] = {}
    t = time.perf_counter()
    # no CUDA context before the data stage forks its workers
    log(f"strata-tiny: device {dev}, torch {torch.__version__}, python {platform.python_version()}, out {out}, work {work}")

    # -- data ------------------------------------------------------------------------------------------------
    extras = D.DEFAULT_EXTRAS if run["extras"] is None else run["extras"]
    col, sources = D.collect(extras, extra_bytes=int(run["extra_mb"] * (1 << 20)),
                             per_package_bytes=int(run["package_mb"] * (1 << 20)), stdlib_limit=run["stdlib_limit"])
    files = col.files
    heldout_text, heldout_files = D.heldout_slice(files, int(run["heldout_kb"] * 1000))
    if not heldout_text:
        raise SystemExit("no held-out files were found in the standard library")
    (out / "strata-tiny-heldout.txt").write_text(heldout_text, encoding="utf-8")
    manifest = {"sources": sources, "files": [f.record() for f in files], "excluded": col.excluded,
                "split_rule": f"stdlib non-test modules: sha256('{D.SPLIT_SALT}' + path) mod 40: 0 heldout, 1-2 val"}
    (out / "manifest.json").write_text(compact_json(manifest))
    by = {s: [f for f in files if f.split == s] for s in ("train", "val", "heldout")}
    log("data: " + ", ".join(f"{s} {len(v)} files {sum(f.nbytes for f in v) / 1e6:.1f} MB" for s, v in by.items())
        + f"; excluded {len(col.excluded)}; held-out slice {len(heldout_text)} chars from {len(heldout_files)} files")
    chats = D.chat_examples(files, a.seed)
    log(f"data: {len(chats)} chat examples ({sum(map(len, chats)) / 1e6:.1f} MB)")
    stages["data"] = time.perf_counter() - t

    # -- tokenizer -----------------------------------------------------------------------------------------------
    t = time.perf_counter()
    from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer

    hf_dir = work / "strata-tiny"  # the directory name becomes the GGUF's general.name
    sample = D.tokenizer_sample([f.text for f in by["train"] if f.base], int(run["tok_sample_mb"] * 1e6))
    make_tiny_hf_tokenizer(hf_dir, mdims["vocab_size"], text=sample)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    stages["tokenizer"] = time.perf_counter() - t
    log(f"tokenizer: {tok.get_vocab_size()} tokens trained on {len(sample) / 1e6:.1f} MB in {stages['tokenizer']:.1f}s")
    t = time.perf_counter()
    docs = [f.text for f in by["train"]] + chats
    random.Random(a.seed).shuffle(docs)
    train_ids = D.encode_stream(hf_dir / "tokenizer.json", docs, eot)
    val_ids = D.encode_stream(hf_dir / "tokenizer.json", [f.text for f in by["val"]], eot)
    heldout_hf_ids = tok.encode(heldout_text, add_special_tokens=False).ids
    stages["encode"] = time.perf_counter() - t
    n_chat_tokens = sum(len(e.ids) for e in tok.encode_batch(chats[:2000])) * len(chats) / max(1, min(2000, len(chats)))
    log(f"encode: train {len(train_ids) / 1e6:.2f} M tokens (~{n_chat_tokens / 1e6:.2f} M in chats), "
        f"val {len(val_ids) / 1e6:.3f} M, held-out slice {len(heldout_hf_ids)} tokens, {stages['encode']:.1f}s")

    # -- model and training ----------------------------------------------------------------------------------------
    if a.family == "glm4moe":
        from tools.tiny.glm import GlmConfig, TinyGlm

        cfg = GlmConfig(**mdims, mtp_weight=a.mtp_weight, mtp_weight_late=a.mtp_weight_late, bias_rate=a.bias_rate)
        model = TinyGlm(cfg)
    else:
        cfg = TinyConfig(**mdims)
        model = TinyMoE(cfg)
    if a.aux is not None:
        cfg.aux_loss_coef = a.aux
    model = model.to(dev)
    if dev.type == "cuda":
        log(f"model: on {torch.cuda.get_device_name(dev)}")
    log(f"model: {cfg.n_params() / 1e6:.2f} M parameters, {cfg.to_dict()}; expected {a.type} GGUF "
        f"~{cfg.gguf_bytes_q8_0() / 1e6:.1f} MB")
    seconds = a.minutes * 60
    targs = TrainArgs(batch=run["batch"], ctx=cfg.ctx, lr=a.lr, min_lr_ratio=a.min_lr, warmup=run["warmup"],
                      seconds=seconds, steps=a.steps,
                      calib_steps=run["calib"], log_every=run["log_every"], evals=run["evals"],
                      val_windows=run["val_windows"], seed=a.seed)
    fwd_model = model
    if a.compile:
        fwd_model = torch.compile(model)
        fwd_model.cfg = cfg
    t = time.perf_counter()
    res = train(fwd_model, train_ids, val_ids, targs, dev, log=log)
    stages["train"] = time.perf_counter() - t
    train_log = {"log": res.pop("log"), "val": res.pop("val"), "stages": stages}
    (out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")
    log(f"train: {res['steps']} steps, {res['tokens_seen'] / 1e6:.1f} M tokens "
        f"({res['tokens_seen'] / max(1, len(train_ids)):.2f} epochs), best val loss {res['best_val_loss']:.4f} "
        f"at step {res['best_step']}, {res['tokens_per_second'] / 1e3:.0f} K tok/s")

    # -- export ----------------------------------------------------------------------------------------------------
    t = time.perf_counter()
    from strata.gguf.convert import convert

    model = model.float().eval()
    save_hf_checkpoint(model, hf_dir, bos_id=eot, eos_id=im_end, pad_id=eot)
    gguf = convert(hf_dir, work / "strata-tiny.gguf", a.type)
    gsize = gguf.stat().st_size
    stages["export"] = time.perf_counter() - t
    log(f"export: {gguf} {gsize / 1e6:.2f} MB ({a.type})"
        + ("" if a.toy or gsize <= MAX_GGUF_BYTES else f" — OVER the {MAX_GGUF_BYTES / 1e6:.0f} MB the package allows"))

    # -- outputs first (a failure in the evaluation below must not lose the model) ------------------------------------
    parts = split_file(gguf, out, int(a.part_mb * 1e6))
    params = cfg.n_params()
    glm = a.family == "glm4moe"
    active = cfg.active_params() if glm else params - cfg.layers * (cfg.experts - cfg.top_k) * 3 * cfg.hidden * cfg.expert_ffn
    mtp_rec = {"layers": cfg.mtp_layers, "params": cfg.mtp_params(), "loss_weight": cfg.mtp_weight,
               "embed_and_head": "shared with the trunk"} if glm else None
    record = {
        "name": "strata-tiny",
        "format": 1,
        "gguf": {"file": "strata-tiny.gguf", "type": a.type, "bytes": gsize, "sha256": sha256_file(gguf),
                 "parts": parts},
        "model": {"family": a.family, "hf_class": "Glm4MoeForCausalLM" if glm else "Qwen3MoeForCausalLM",
                  **cfg.to_dict(), "params": params, "active_params": active, "mtp": mtp_rec,
                  "tied_embeddings": True, "shared_experts": cfg.shared_experts if glm else 0,
                  "routing": "sigmoid, correction bias, top-k renormalised" if glm else "softmax, top-k renormalised"},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "trained_on_chars": len(sample),
                      "sha256": sha256_file(hf_dir / "tokenizer.json"), "chat_template": "qwen3"},
        "data": {"sources": sources, "files": {s: len(v) for s, v in by.items()},
                 "bytes": {s: sum(f.nbytes for f in v) for s, v in by.items()}, "excluded": len(col.excluded),
                 "chat_examples": len(chats), "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
                 "manifest_sha256": sha256_file(out / "manifest.json")},
        "training": {"command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]) if argv is None else
                     "tools/train_tiny.py " + " ".join(argv),
                     "toy": a.toy, "seed": a.seed, "device": str(dev),
                     "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
                     "torch": torch.__version__, "python": platform.python_version(), "minutes": a.minutes,
                     "batch": targs.batch, "ctx": cfg.ctx, "lr": targs.lr, "warmup": targs.warmup,
                     "min_lr_ratio": targs.min_lr_ratio, "mtp_weight": cfg.mtp_weight if glm else None,
                     "mtp_weight_late": cfg.mtp_weight_late if glm else None,
                     "bias_rate": cfg.bias_rate if glm else None,
                     "weight_decay": targs.weight_decay, "aux_loss_coef": cfg.aux_loss_coef,
                     "precision": "bf16 autocast, f32 weights" if dev.type == "cuda" else "f32",
                     "epochs": res["tokens_seen"] / max(1, len(train_ids)), **res,
                     "final_loss": train_log["log"][-1]["loss"] if train_log["log"] else None},
        "heldout": {"file": "tests/data/strata-tiny-heldout.txt", "license": "PSF-2.0 (Python standard library)",
                    "chars": len(heldout_text), "sha256": hashlib.sha256(heldout_text.encode()).hexdigest(),
                    "ctx": cfg.ctx, "files": heldout_files},
        "perplexity": {"strata": None, "train_f32": None, "hf_f32": None},
        "mtp": None,
        "routing": None,
        "completions": None,
        "stages_seconds": {},
        "total_seconds": None,
    }

    def save() -> None:
        record["stages_seconds"] = {k: round(v, 1) for k, v in stages.items()}
        record["total_seconds"] = round(time.perf_counter() - T0, 1)
        (out / "strata-tiny.json").write_text(json.dumps(record, indent=1) + "\n")
        train_log["stages"] = record["stages_seconds"]
        (out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")

    save()
    for p in parts:
        log(f"out: {p['file']} {p['bytes']} bytes sha256 {p['sha256']}")

    # -- evaluation: strata on the held-out slice (CPU, float32), then the oracles ----------------------------------
    t = time.perf_counter()
    try:
        fill_strata_numbers(record, gguf, heldout_text, run["n_predict"], log=log, speed=not a.toy or a.speed,
                            mtp_budget_s=a.mtp_eval_s)
    except Exception:  # the model is saved; tools/tiny/install.py can compute these numbers later, on any CPU
        import traceback

        record["eval_error"] = traceback.format_exc()[-2000:]
        log("eval: strata's evaluation FAILED (the model is saved):\n" + record["eval_error"])
        save()
        return 1
    stages["eval_strata"] = time.perf_counter() - t
    record["heldout"]["tokenizer_agrees"] = record["heldout"].pop("ids") == heldout_hf_ids
    save()
    t = time.perf_counter()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ppl = record["perplexity"]
    try:
        ppl["train_f32"] = module_perplexity(lambda x: model(x)[0], heldout_hf_ids, cfg.ctx, dev)
        if glm and (record["mtp"] or {}).get("teacher_forced") is not None:
            record["mtp"]["teacher_forced"]["train_f32_top1"] = module_mtp_accuracy(model, heldout_hf_ids, cfg.ctx, dev)
        if not a.no_hf_check:
            ppl["hf_f32"] = hf_perplexity(hf_dir, heldout_hf_ids, cfg.ctx, "cpu")
    except Exception as e:  # the oracles are checks, not the product: record why one could not run
        ppl["oracle_error"] = f"{e.__class__.__name__}: {e}"[:300]
    stages["eval_oracles"] = time.perf_counter() - t
    log(f"eval: perplexity strata {ppl['strata']:.3f}, trained module f32 {ppl['train_f32']}, "
        f"transformers f32 {ppl['hf_f32']}")
    save()
    log(f"out: strata-tiny.gguf sha256 {record['gguf']['sha256']} ({gsize} bytes); done in {record['total_seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
