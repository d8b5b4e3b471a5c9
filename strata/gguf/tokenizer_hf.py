"""Hugging Face tokenizers <-> GGUF tokenizer metadata, and a tiny trained tokenizer for tests and synthetic models.

- ``hf_tokenizer_to_metadata(dir)``: the ``tokenizer.ggml.*`` keys (+ ``tokenizer.chat_template``) of a
  transformers checkpoint directory (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``).
  The pre-tokenizer name is found by behaviour, like llama.cpp's converter does: the checkpoint's normalizer and
  pre-tokenizer split a probe text, and the first known pre-tokenizer that splits it identically names it.
- ``write_tokenizer_metadata(writer, md)``: writes those keys into a ``gguf.GGUFWriter`` with the GGUF types
  llama.cpp expects.
- ``make_tiny_hf_tokenizer(out_dir)``: trains a small Qwen-style byte-level BPE (deterministic, ~1 s).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from strata import StrataError
from strata.gguf.tokenizer import _SPM_SPACE, PRE_TOKENIZERS, TokenType

# Probe text for pre-tokenizer detection: whitespace runs, newlines, digit runs, English contractions in both
# cases, accented and cased scripts, CJK, Hangul, kana, emoji, punctuation runs, full-width forms.
PROBE_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL Ｆｕｌｌ　ｗｉｄｔｈ ﬁ "
    "Ὗώ ΐ Ωmega Kelvin µ ÀÖØöø Ꭰᏸ こんにちは カタカナ 한국어 abc/def\\ghi <tag attr=\"v\"> a_b-c.d:e;f "
    "x+=1 y==2 z!=3 [1,2,3] {a:1} 1,000,000.50 ½ ¼ Ⅻ ① ٣ १२ \r\n\r\n end  "
)

# Pre-tokenizer names tried in this order; the first whose behaviour matches the checkpoint's is used.
_PREFERRED = ("qwen2", "llama-bpe", "gpt-2", "deepseek-v3", "deepseek-llm", "deepseek-coder", "dbrx", "megrez",
              "gpt-4o", "tekken", "seed-coder", "bailingmoe", "starcoder", "default")

_LOOKS_SPECIAL = (("<|", "|>"), ("<\uff5c", "\uff5c>"))  # <|...|>, <｜...｜> (DeepSeek's full-width bars)


def _split_with(pre: Any, normalizer: Any, text: str) -> list[str]:
    if normalizer is not None:
        text = normalizer.normalize_str(text)
    return [p for p, _ in pre.pre_tokenize_str(text)]


def _our_pre_tokenizer(name: str):
    import tokenizers
    from tokenizers import normalizers, pre_tokenizers

    pre = PRE_TOKENIZERS[name]
    seq = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return seq, (normalizers.NFC() if pre.nfc else None)


def detect_pre_tokenizer(tokenizer_json: str | Path) -> str:
    """The ``tokenizer.ggml.pre`` name whose splitting matches this ``tokenizer.json``'s (normalizer included)."""
    import tokenizers

    tj = _read_json(Path(tokenizer_json))
    try:
        hf = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions for a bad file
        raise StrataError(f"{tokenizer_json} cannot be loaded by the tokenizers library: {e}") from None
    if hf.pre_tokenizer is None:
        raise StrataError(f"{tokenizer_json}: byte-level BPE without a pre-tokenizer is not supported")
    want = _split_with(hf.pre_tokenizer, hf.normalizer, PROBE_TEXT)
    ignore_merges = bool(tj.get("model", {}).get("ignore_merges", False))
    for name in _PREFERRED:
        if PRE_TOKENIZERS[name].ignore_merges != ignore_merges:
            continue
        pre, norm = _our_pre_tokenizer(name)
        if _split_with(pre, norm, PROBE_TEXT) == want:
            return name
    raise StrataError(f"{tokenizer_json}: its pre-tokenizer matches none that strata knows "
                      f"({json.dumps(tj.get('pre_tokenizer'))[:300]})")


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _has_byte_level(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel":
            return True
        return any(_has_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_byte_level(v) for v in node)
    return False


def _read_json(path: Path) -> dict:
    """A tokenizer file's JSON object, or a StrataError naming the file (a download cut short, a hand edit)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise StrataError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise StrataError(f"{path} is not valid JSON: not UTF-8 text") from None
    except OSError as e:
        raise StrataError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path} is not a JSON object")
    return data


def hf_tokenizer_to_metadata(hf_dir: str | Path) -> dict[str, Any]:
    """GGUF tokenizer metadata for a transformers checkpoint directory (byte-level BPE tokenizers, and
    SentencePiece-style BPE ones with byte fallback such as Llama 2's and Mixtral's)."""
    hf_dir = Path(hf_dir)
    tj_path = hf_dir / "tokenizer.json"
    if not tj_path.is_file():
        raise StrataError(f"{hf_dir} has no tokenizer.json (only fast tokenizers can be converted)")
    tj = _read_json(tj_path)
    cfg_path = hf_dir / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}

    model = tj.get("model") or {}
    byte_level = _has_byte_level(tj.get("pre_tokenizer")) or _has_byte_level(tj.get("decoder"))
    spm = _is_sentencepiece_bpe(tj)
    if model.get("type") != "BPE" or not (byte_level or spm):
        raise StrataError(f"{tj_path}: only byte-level BPE and SentencePiece-style BPE tokenizers can be converted "
                          f"(model type {model.get('type')!r})")

    vocab: dict[str, int] = model["vocab"]
    added = tj.get("added_tokens") or []
    n = max([*vocab.values(), *(a["id"] for a in added)]) + 1
    tokens: list[str | None] = [None] * n
    types = [int(TokenType.NORMAL)] * n
    for t, i in vocab.items():
        tokens[i] = t
        if spm and _BYTE_TOKEN.fullmatch(t):
            types[i] = int(TokenType.BYTE)
    if spm and model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = int(TokenType.UNKNOWN)
    for a in added:
        content = a["content"]
        if tokens[a["id"]] is not None and types[a["id"]] != TokenType.NORMAL:
            continue  # <unk> / byte tokens listed as added tokens keep their kind
        tokens[a["id"]] = content
        special = a.get("special") or any(content.startswith(p) and content.endswith(s) for p, s in _LOOKS_SPECIAL)
        types[a["id"]] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    for i, t in enumerate(tokens):
        if t is None:  # gaps in the id space are filled like llama.cpp's converter does
            tokens[i] = f"[PAD{i}]"
            types[i] = int(TokenType.USER_DEFINED)

    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    md: dict[str, Any]
    if byte_level:
        md = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": detect_pre_tokenizer(tj_path),
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
        }
    else:
        md = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": _scores_from_merges(tokens, types, model.get("merges") or []),
            "tokenizer.ggml.token_type": types,
        }
        if not _adds_space_prefix(tj):
            md["tokenizer.ggml.add_space_prefix"] = False

    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding"), ("sep_token", "seperator")):
        content = _token_content(cfg.get(name))
        if content is not None:
            if content not in ids:
                raise StrataError(f"{cfg_path}: {name} {content!r} is not in the vocabulary")
            md[f"tokenizer.ggml.{key}_token_id"] = ids[content]
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(cfg.get(flag), bool):
            md[f"tokenizer.ggml.{flag}"] = cfg[flag]
    if "tokenizer.ggml.add_bos_token" not in md:
        md["tokenizer.ggml.add_bos_token"] = _post_processor_adds(tj, md.get("tokenizer.ggml.bos_token_id"), tokens)

    template = _chat_template(hf_dir, cfg)
    if template:
        md["tokenizer.chat_template"] = template
    return md


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _nodes(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _nodes(v)
    elif isinstance(node, list):
        for v in node:
            yield from _nodes(v)


def _is_sentencepiece_bpe(tj: dict) -> bool:
    """Llama/Mistral-style: BPE with byte fallback, spaces turned into ``▁`` by the normalizer or a Metaspace."""
    if not (tj.get("model") or {}).get("byte_fallback"):
        return False
    parts = [*_nodes(tj.get("normalizer")), *_nodes(tj.get("pre_tokenizer"))]
    return any(p.get("type") == "Metaspace" or (p.get("type") == "Replace" and p.get("content") == _SPM_SPACE)
               for p in parts)


def _adds_space_prefix(tj: dict) -> bool:
    for p in [*_nodes(tj.get("normalizer")), *_nodes(tj.get("pre_tokenizer"))]:
        if p.get("type") == "Prepend" and p.get("prepend") == _SPM_SPACE:
            return True
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always") != "never" and p.get("add_prefix_space", True)
    return False


def _scores_from_merges(tokens: list[str], types: list[int], merges: list) -> list[float]:
    """SentencePiece scores that make llama.cpp (and strata) merge in the order of tokenizer.json's merge list:
    the piece made by merge k scores -k; pieces no merge makes score below all of them."""
    floor = -float(len(merges) + 1)
    rank: dict[str, float] = {}
    for k, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(a + b, -float(k))
    return [rank.get(t, 0.0 if len(t) == 1 or types[i] != TokenType.NORMAL else floor)
            for i, t in enumerate(tokens)]


def _post_processor_adds(tj: dict, token_id: int | None, tokens: list[str]) -> bool:
    """Whether tokenizer.json's post-processor puts ``token_id`` in front of single sequences."""
    if token_id is None:
        return False
    text = json.dumps(tj.get("post_processor") or {})
    return json.dumps(tokens[token_id]) in text and '"single"' in text


def _chat_template(hf_dir: Path, cfg: dict) -> str | None:
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    t = cfg.get("chat_template")
    if isinstance(t, list):  # named templates: the default one renders chats
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) else None


# GGUF value types of the tokenizer keys (llama.cpp reads token ids as uint32, token types as int32)
def _gguf_type(key: str, value: Any):
    from gguf import GGUFValueType as V

    arrays = {"tokenizer.ggml.tokens": V.STRING, "tokenizer.ggml.merges": V.STRING,
              "tokenizer.ggml.token_type": V.INT32, "tokenizer.ggml.scores": V.FLOAT32}
    if key in arrays:
        return V.ARRAY, arrays[key]
    if key.endswith("_token_id"):
        return V.UINT32, None
    if isinstance(value, bool):
        return V.BOOL, None
    if isinstance(value, str):
        return V.STRING, None
    if isinstance(value, int):
        return V.UINT32, None
    if isinstance(value, float):
        return V.FLOAT32, None
    raise StrataError(f"cannot write tokenizer metadata {key!r} of type {type(value).__name__}")


def write_tokenizer_metadata(writer: Any, md: dict[str, Any]) -> None:
    """Write the ``tokenizer.*`` keys of ``md`` into a ``gguf.GGUFWriter``."""
    for key, value in md.items():
        if not key.startswith("tokenizer."):
            continue
        vtype, sub = _gguf_type(key, value)
        if sub is not None:
            value = list(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)


# --------------------------------------------------------------------------------------------------------------
# Tiny tokenizer

TINY_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model that is larger than the memory of the GPU can still run:
the experts that are used most often stay in the cache, and the others are computed by the CPU where they lie,
or copied over the PCIe link when that is faster. Every token, in every layer, uses only a few of the experts.
Hello, world! How are you today? I'm fine, thanks; we'll see what they've done. It's 3:45 pm on 2024-05-17.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 65536 3.14159 2.71828 -1 +1 1e-6 0x1F 50% $19.99.
Questions and answers, lists and tables, code and prose: a tokenizer sees them all, one byte at a time.
def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

class Cache:
    def __init__(self, slots):
        self.slots = slots  # number of experts that fit in VRAM
        self.map = {}

    def lookup(self, layer, expert):
        return self.map.get((layer, expert), -1)

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
[{"role": "user", "content": "What is the weather like in Paris?"}]
<html><body><p>Hello</p></body></html>
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;
Le renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt über den faulen Hund.
El veloz murciélago hindú comía feliz cardillo y kiwi. Съешь же ещё этих мягких французских булок, да выпей чаю.
我想在苹果工作。今天天气很好，我们去公园散步吧。日本語のテキストも少し。한국어 문장도 조금 있습니다.
Emoji: 🚀 🦙 😁 ✅ 🌫️ — dashes – and “quotes” and ‘single quotes’ … ellipsis.
"""


def _tiny_corpus() -> list[str]:
    """The built-in training text: the paragraph above plus the names of the characters of a few Unicode blocks
    (names of characters assigned before Unicode 4 never change, so the corpus is the same on every Python)."""
    import unicodedata

    names = []
    for lo, hi in ((0x20, 0x7E), (0xA0, 0x17F), (0x391, 0x3C9), (0x410, 0x44F), (0x2190, 0x21FF),
                   (0x2200, 0x22FF), (0x2500, 0x257F)):
        for cp in range(lo, hi + 1):
            name = unicodedata.name(chr(cp), None)
            if name:
                names.append(f"{chr(cp)} is {name.lower()}.")
    return _TINY_CORPUS.splitlines(keepends=True) * 4 + names


def make_tiny_hf_tokenizer(out_dir: str | Path, vocab_size: int = 2048, text: str | None = None) -> Path:
    """Train a small Qwen-style byte-level BPE and save a transformers-loadable tokenizer directory.

    ``vocab_size`` counts everything: 256 byte tokens, merges, then the 3 special tokens (``<|endoftext|>``,
    ``<|im_start|>``, ``<|im_end|>``) and 4 plain added tokens (``<think>``, ``</think>``, ``<tool_call>``,
    ``</tool_call>``) at the end, like Qwen3. Deterministic for a given ``text`` (default: a built-in corpus).
    """
    import tokenizers
    from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers

    n_extra = len(TINY_SPECIAL) + len(TINY_ADDED)
    if vocab_size < 256 + n_extra + 1:
        raise StrataError(f"tiny tokenizer vocab_size {vocab_size} is too small (at least {256 + n_extra + 1})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    pre, _ = _our_pre_tokenizer("qwen2")
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_extra, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    corpus = [text] if text is not None else _tiny_corpus()
    tok.train_from_iterator(corpus, trainer=trainer)
    base = tok.get_vocab_size()
    if base < vocab_size - n_extra:
        # too little text for that many merges: fill the id space so that the size is what was asked for
        tok.add_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                        for i in range(vocab_size - n_extra - base)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_ADDED])
    tok.save(str(out / "tokenizer.json"))

    template = _qwen3_template()
    decoder = {}
    for t in (*TINY_SPECIAL, *TINY_ADDED):
        decoder[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False,
                                            "rstrip": False, "single_word": False,
                                            "special": t in TINY_SPECIAL}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    special_map = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": list(TINY_SPECIAL)}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return out


def _qwen3_template() -> str:
    from strata.gguf.builtin_templates import QWEN3_TEMPLATE

    return QWEN3_TEMPLATE
