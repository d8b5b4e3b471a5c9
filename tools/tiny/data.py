"""strata-tiny's training text: found on the machine itself, licensed permissively, split deterministically.

Sources, in this order:
- the Python standard library's ``.py`` files (``sysconfig.get_paths()['stdlib']``, its tests included;
  PSF-2.0), without ``site-packages``;
- optionally the ``.py`` files of a fixed list of installed distributions whose licences are permissive
  (``EXTRA_PACKAGES``, each with its SPDX id; capped per package and in total, chosen by a hash of the path).

Every file is recorded (source, path, bytes, sha256, split) in the manifest. Files are deduplicated by content;
files that are not UTF-8, larger than ``max_file_bytes``, or that contain the tokenizer's special-token text
(a chat template inside a library, say) are left out and listed with the reason.

Split: standard-library modules that are not tests go to ``heldout`` or ``val`` by a hash of their relative
path (stable across Python versions); everything else trains. The held-out *slice* shipped with the
repository is taken from the held-out files, so CI never reads a stdlib (whose version differs).

Chat examples: from the training files, each public function with a docstring becomes a user request (the
docstring's summary) answered by the function's source in a code block, formatted like the Qwen3 chat template,
so that ``strata chat`` on the trained model answers with code.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# distribution name -> its licence (SPDX). Only these are ever read; a missing one is skipped and recorded.
EXTRA_PACKAGES = {
    "numpy": "BSD-3-Clause",
    "torch": "BSD-3-Clause",
    "transformers": "Apache-2.0",
    "sympy": "BSD-3-Clause",
    "networkx": "BSD-3-Clause",
    "jinja2": "BSD-3-Clause",
    "requests": "Apache-2.0",
    "urllib3": "MIT",
    "httpx": "BSD-3-Clause",
    "click": "BSD-3-Clause",
    "rich": "MIT",
    "pygments": "BSD-2-Clause",
    "pytest": "MIT",
    "huggingface_hub": "Apache-2.0",
    "fsspec": "BSD-3-Clause",
    "packaging": "Apache-2.0 OR BSD-2-Clause",
    "psutil": "BSD-3-Clause",
    "anyio": "MIT",
    "h11": "MIT",
    "markdown-it-py": "MIT",
    # added for the second version (after the first list, so that the first run's selection is unchanged)
    "mpmath": "BSD-3-Clause",
    "triton": "MIT",
    "scipy": "BSD-3-Clause",
    "pandas": "BSD-3-Clause",
    "pydantic": "MIT",
    "starlette": "BSD-3-Clause",
    "fastapi": "MIT",
    "uvicorn": "BSD-3-Clause",
    "gguf": "MIT",
    "pyyaml": "MIT",
    "idna": "BSD-3-Clause",
    "charset-normalizer": "MIT",
    "markupsafe": "BSD-3-Clause",
    "typing_extensions": "PSF-2.0",
}
DEFAULT_EXTRAS = tuple(EXTRA_PACKAGES)
BASE_PACKAGES = DEFAULT_EXTRAS[: DEFAULT_EXTRAS.index("markdown-it-py") + 1]  # the first run's list
SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEST_DIRS = {"test", "tests", "idle_test"}
SPLIT_SALT = "strata-tiny/1:"
BASE_PACKAGE_BYTES, BASE_EXTRA_BYTES = 8 << 20, 48 << 20  # the first run's caps (see SourceFile.base)


@dataclass
class SourceFile:
    source: str  # "stdlib" or a distribution name
    rel: str  # path relative to the stdlib / the distribution's location, with "/"
    sha256: str
    nbytes: int
    text: str = field(repr=False)
    split: str = "train"  # train | val | heldout
    base: bool = True  # within the first run's caps (8 MB a package, 48 MB in all): the tokenizer's sample

    def record(self) -> dict:
        return {"source": self.source, "path": self.rel, "bytes": self.nbytes, "sha256": self.sha256,
                "split": self.split}


def _key(s: str) -> int:
    return int.from_bytes(hashlib.sha256((SPLIT_SALT + s).encode()).digest()[:8], "big")


def is_test(rel: str) -> bool:
    parts = rel.split("/")
    return bool(TEST_DIRS & set(parts[:-1])) or parts[-1].startswith("test_")


def split_of(rel: str, heldout_mod: int = 40) -> str:
    """heldout / val / train for a stdlib module path: 1 in ``heldout_mod`` held out, 2 in ``heldout_mod`` for
    validation; tests and the generated codec tables of ``encodings/`` always train."""
    if is_test(rel) or rel.startswith("encodings/"):
        return "train"
    k = _key(rel) % heldout_mod
    return "heldout" if k == 0 else "val" if k in (1, 2) else "train"


class Collector:
    def __init__(self, max_file_bytes: int):
        self.max_file_bytes = max_file_bytes
        self.files: list[SourceFile] = []
        self.excluded: list[dict] = []
        self.seen: set[str] = set()

    def add(self, source: str, rel: str, path: Path) -> SourceFile | None:
        try:
            raw = path.read_bytes()
        except OSError as e:
            self.excluded.append({"source": source, "path": rel, "reason": f"unreadable: {e.__class__.__name__}"})
            return None
        sha = hashlib.sha256(raw).hexdigest()
        why = None
        if len(raw) > self.max_file_bytes:
            why = "too large"
        elif sha in self.seen:
            why = "duplicate content"
        elif not raw.strip():
            why = "empty"
        if why is None:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                why = "not UTF-8"
        if why is None and any(s in text for s in SPECIAL_TEXT):
            why = "contains special-token text"
        if why is not None:
            self.excluded.append({"source": source, "path": rel, "bytes": len(raw), "sha256": sha, "reason": why})
            return None
        self.seen.add(sha)
        f = SourceFile(source, rel, sha, len(raw), text.replace("\r\n", "\n"))
        self.files.append(f)
        return f


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect(extras: tuple[str, ...] = DEFAULT_EXTRAS, extra_bytes: int = 48 << 20, per_package_bytes: int = 8 << 20,
            max_file_bytes: int = 400_000, stdlib_limit: int | None = None, heldout_mod: int = 40) -> tuple[Collector, dict]:
    """All source files, split; plus a description of the sources (paths, versions, licences)."""
    import importlib.metadata as md
    import platform

    c = Collector(max_file_bytes)
    root = stdlib_root()
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                  if not ({"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)))
    if stdlib_limit is not None:  # toy runs: a deterministic subset, held-out and val files kept
        keep = [r for r in rels if split_of(r, heldout_mod) != "train"][: stdlib_limit // 3]
        rels = sorted(set(keep) | set(sorted(rels, key=_key)[: stdlib_limit - len(keep)]))
    for rel in rels:
        f = c.add("stdlib", rel, root / rel)
        if f is not None:
            f.split = split_of(rel, heldout_mod)
    sources = {"stdlib": {"path": str(root), "python": platform.python_version(), "license": "PSF-2.0",
                          "files": sum(1 for f in c.files if f.source == "stdlib"),
                          "bytes": sum(f.nbytes for f in c.files if f.source == "stdlib")}}
    budget, base_budget = extra_bytes, BASE_EXTRA_BYTES
    for name in extras:
        if name not in EXTRA_PACKAGES:
            raise ValueError(f"{name} is not in the list of permissively licensed packages (EXTRA_PACKAGES)")
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            sources[name] = {"installed": False}
            continue
        files = [f for f in (dist.files or []) if str(f).endswith(".py")]
        files.sort(key=lambda f: _key(name + "/" + f.as_posix()))
        got = n = base_got = 0
        for f in files:
            if got >= min(per_package_bytes, budget):
                break
            sf = c.add(name, f.as_posix(), Path(dist.locate_file(f)))
            if sf is not None:
                # the files the first run took (the same order, its caps): the tokenizer is trained on them only,
                # so that larger caps keep the same tokenizer and perplexities stay comparable
                sf.base = name in BASE_PACKAGES and base_got < min(BASE_PACKAGE_BYTES, base_budget)
                base_got += sf.nbytes if sf.base else 0
                got, n = got + sf.nbytes, n + 1
        budget -= got
        base_budget -= base_got
        meta = dist.metadata
        sources[name] = {"installed": True, "version": dist.version, "license": EXTRA_PACKAGES[name],
                         "license_metadata": meta.get("License-Expression") or (meta.get("License") or "")[:200],
                         "license_classifiers": [x for x in (meta.get_all("Classifier") or []) if "License" in x],
                         "files": n, "bytes": got}
    return c, sources


def heldout_slice(files: list[SourceFile], target_chars: int, per_file_chars: int = 12_000) -> tuple[str, list[dict]]:
    """A deterministic slice of the held-out files: whole lines, at most ``per_file_chars`` of each file."""
    parts, used, total = [], [], 0
    for f in sorted((f for f in files if f.split == "heldout"), key=lambda f: _key(f.rel)):
        if target_chars - total < min(500, target_chars // 4):  # no slivers at the end
            break
        take = f.text[: min(per_file_chars, target_chars - total)]
        if len(take) < len(f.text):
            take = take[: take.rfind("\n") + 1]
        if not take.strip():
            continue
        parts.append(take)
        total += len(take)
        used.append({"path": f.rel, "sha256": f.sha256, "chars": len(take)})
    return "\n".join(parts), used


# --------------------------------------------------------------------------------------------------------------
# chat examples

SYSTEMS = ("You are a helpful assistant.", "You are a helpful coding assistant.",
           "You are strata-tiny, a small model trained on Python source code.")
ASKS = ("{doc}", "Write a Python function: {doc}", "Implement `{name}` in Python. {doc}",
        "Write a function named {name}. {doc}", "How would you write {name}()? {doc}",
        "Python code, please. {doc}")


def _summary(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0]
    s = " ".join(para.split())
    if not 20 <= len(s) <= 300 or s.startswith((">>>", "..", ":")):
        return None
    return s


def _defs(body: list):
    """Function definitions among statements, in classes and functions too (no descent into expressions)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
            yield from _defs(node.body)
        elif isinstance(node, ast.ClassDef):
            yield from _defs(node.body)
        elif isinstance(node, (ast.If, ast.Try)):
            yield from _defs(node.body + node.orelse + getattr(node, "finalbody", []))


def _functions(text: str) -> list[tuple[str, str, str]]:
    """(name, docstring summary, dedented source) of public functions with a docstring, 3..50 lines long."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    out = []
    for node in _defs(tree.body):
        if node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        s = _summary(doc) if doc else None
        if s is None or node.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        if not 3 <= node.end_lineno - start + 1 <= 50:
            continue
        src = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
        out.append((node.name, s, src))
    return out


def chat_text(system: str | None, user: str, answer: str) -> str:
    """One conversation as the Qwen3 template renders it (the reply with an empty thinking block)."""
    s = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return (s + f"<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n<think>\n\n</think>\n\n{answer}<|im_end|>\n")


def chat_examples(files: list[SourceFile], seed: int, workers: int | None = None) -> list[str]:
    """Conversations from the training files that are not tests (test docstrings make poor requests)."""
    texts = [f.text for f in files if f.split == "train" and not is_test(f.rel)]
    workers = workers or min(16, os.cpu_count() or 1)
    if workers > 1 and len(texts) > 64:
        with ProcessPoolExecutor(workers) as ex:
            found = list(ex.map(_functions, texts, chunksize=16))
    else:
        found = [_functions(t) for t in texts]
    rng = random.Random(seed)
    out = []
    for per_file in found:
        for name, doc, src in per_file:
            system = rng.choice(SYSTEMS) if rng.random() < 0.3 else None
            user = rng.choice(ASKS).format(doc=doc, name=name)
            out.append(chat_text(system, user, f"```python\n{src}\n```"))
    return out


# --------------------------------------------------------------------------------------------------------------
# tokenization

def tokenizer_sample(docs: list[str], max_chars: int) -> str:
    """A deterministic sample of the training documents for the BPE trainer."""
    out, n = [], 0
    for d in sorted(docs, key=lambda d: _key(d[:200] + str(len(d)))):
        if n >= max_chars:
            break
        out.append(d)
        n += len(d)
    return "\n".join(out)


def encode_stream(tokenizer_json: Path, docs: list[str], sep_id: int) -> np.ndarray:
    """All documents' ids, each followed by ``sep_id`` (int32)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts = []
    for i in range(0, len(docs), 4096):
        for e in enc(docs[i : i + 4096], add_special_tokens=False):
            parts.append(np.asarray(e.ids, dtype=np.int32))
            parts.append(np.asarray([sep_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
