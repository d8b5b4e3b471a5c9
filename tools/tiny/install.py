#!/usr/bin/env python3
"""Put a strata-tiny training run's outputs in place in the repository, verifying every byte.

    python tools/tiny/install.py RUN_DIR [--root REPO]

RUN_DIR is what ``tools/train_tiny.py --out`` wrote (read only is fine). The GGUF is reassembled from its
``.partN`` pieces when it was split (each piece and the whole checked against the sha256s recorded in
strata-tiny.json), then:

  strata/data/strata-tiny.gguf, strata/data/strata-tiny.json     the shipped model and its recorded numbers
  tests/data/strata-tiny-heldout.{txt,md}                        the held-out slice CI measures, its source and licence
  docs/strata-tiny/{train_log,manifest}.json, *.png              the log, the data manifest, the figures
  docs/strata-tiny.md                                            its GENERATED section, from the JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def join_gguf(run: Path, rec: dict, dst: Path) -> None:
    """Reassemble (or copy) the GGUF into ``dst``, checking the recorded sha256 of every piece and the whole."""
    g = rec["gguf"]
    tmp = dst.with_name(dst.name + ".tmp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out:
        for part in g["parts"]:
            src = run / part["file"]
            if not src.is_file():
                raise SystemExit(f"{src} is missing")
            if sha256(src) != part["sha256"]:
                raise SystemExit(f"{src}: sha256 differs from the recorded one")
            with open(src, "rb") as f:
                shutil.copyfileobj(f, out)
    got = sha256(tmp)
    if got != g["sha256"] or tmp.stat().st_size != g["bytes"]:
        tmp.unlink()
        raise SystemExit(f"reassembled GGUF: sha256 {got} is not the recorded {g['sha256']}")
    tmp.replace(dst)
    print(f"{dst}: {g['bytes']} bytes, sha256 {got} (from {len(g['parts'])} piece(s))")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="the training run's output directory")
    p.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    p.add_argument("--no-doc", action="store_true", help="skip the figures and the doc update (no matplotlib)")
    a = p.parse_args(argv)
    run, root = Path(a.run), Path(a.root)
    rec = json.loads((run / "strata-tiny.json").read_text())
    if rec.get("training", {}).get("toy") and root == ROOT:
        print("warning: this is a --toy run", file=sys.stderr)
    gguf = root / "strata" / "data" / "strata-tiny.gguf"
    join_gguf(run, rec, gguf)
    held = (run / "strata-tiny-heldout.txt").read_text(encoding="utf-8")
    if hashlib.sha256(held.encode()).hexdigest() != rec["heldout"]["sha256"]:
        raise SystemExit("strata-tiny-heldout.txt: sha256 differs from the recorded one")
    if rec.get("routing") is None or rec["perplexity"].get("strata") is None:
        # the run saved the model but did not finish measuring it: strata's numbers are CPU float32 anyway
        print("the run has no strata numbers (eval_error in its JSON?): measuring them here", file=sys.stderr)
        sys.path.insert(0, str(ROOT))
        from tools.tiny.evaluate import N_PREDICT, fill_strata_numbers

        fill_strata_numbers(rec, gguf, held, 8 if rec["training"].get("toy") else N_PREDICT)
        rec["heldout"].pop("ids")
        rec["perplexity"]["strata_measured_at_install"] = True
        rec.pop("eval_error", None)
    (root / "strata" / "data" / "strata-tiny.json").write_text(json.dumps(rec, indent=1) + "\n")
    dst = root / rec["heldout"]["file"]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes((run / "strata-tiny-heldout.txt").read_bytes())
    h = rec["heldout"]
    note = [f"# {dst.name}", "",
            f"Held-out text for strata-tiny (docs/strata-tiny.md): whole lines from modules of the Python "
            f"{rec['data']['sources']['stdlib']['python']} standard library, which are licensed under the PSF License "
            f"Agreement (PSF-2.0), Copyright (c) 2001 Python Software Foundation; All Rights Reserved. "
            f"The training split excludes these modules.", "", "| module | sha256 of the whole file | characters used |",
            "|---|---|---|"] + [f"| Lib/{f['path']} | `{f['sha256']}` | {f['chars']} |" for f in h["files"]]
    dst.with_suffix(".md").write_text("\n".join(note) + "\n", encoding="utf-8")
    docs = root / "docs" / "strata-tiny"
    docs.mkdir(parents=True, exist_ok=True)
    for name in ("train_log.json", "manifest.json"):
        shutil.copyfile(run / name, docs / name)
    print(f"{root / 'strata/data/strata-tiny.json'}, {dst}, {docs}/{{train_log,manifest}}.json")
    if not a.no_doc:
        sys.path.insert(0, str(ROOT))
        from tools.tiny.report import main as report

        report(["--record", str(root / "strata/data/strata-tiny.json"), "--train-log", str(docs / "train_log.json"),
                "--doc", str(root / "docs" / "strata-tiny.md")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
