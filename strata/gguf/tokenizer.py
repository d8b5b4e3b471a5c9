"""Tokenizer built from GGUF metadata (the `tokenizer.ggml.*` keys), on the `tokenizers` library.

Two vocabulary kinds are supported:

- ``gpt2``: byte-level BPE (GPT-2, Llama 3, Qwen2/3, DeepSeek, ...). The pre-tokenizer that splits text into
  words before BPE is chosen by ``tokenizer.ggml.pre`` (see ``PRE_TOKENIZERS``); the regexes are the ones the
  models' own ``tokenizer.json`` files use.
- ``llama``: SentencePiece-style BPE with scores (Llama 1/2, Mistral v1, ...): spaces become ``▁``, a space is
  prefixed to each text run (``add_space_prefix``), characters missing from the vocabulary fall back to
  ``<0xXX>`` byte tokens. The merge order is derived from the scores: the pair whose merged piece scores highest
  merges first, which is the rule SentencePiece's BPE uses.

Special tokens (CONTROL, USER_DEFINED and UNKNOWN types) are matched in the raw text before BPE, longest first;
with ``parse_special=False`` only USER_DEFINED tokens (e.g. ``<think>``) are, the same split llama.cpp and
Hugging Face tokenizers make.
"""

from __future__ import annotations

import codecs
import functools
import logging
import re
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Iterable, Sequence


from strata import StrataError

log = logging.getLogger(__name__)


class TokenType(IntEnum):
    """GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# GGUF metadata is read by strata.gguf.reader (kept importable from here for callers of the tokenizer)
from strata.gguf.reader import read_gguf_metadata  # noqa: E402,F401


# --------------------------------------------------------------------------------------------------------------
# Pre-tokenizers (tokenizer.ggml.pre -> the regexes of the model's tokenizer.json, applied in sequence, each
# match isolated as its own piece)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Cased letters (as code point ranges, written in hex so that no editor normalizes them)
_DEEPSEEK_LETTERS = (
    (0x0041, 0x005A), (0x0061, 0x007A), (0x00B5, 0x00B5), (0x00C0, 0x00D6), (0x00D8, 0x00F6), (0x00F8, 0x01BA),
    (0x01BC, 0x01BF), (0x01C4, 0x0293), (0x0295, 0x02AF), (0x0370, 0x0373), (0x0376, 0x0377), (0x037B, 0x037D),
    (0x037F, 0x037F), (0x0386, 0x0386), (0x0388, 0x038A), (0x038C, 0x038C), (0x038E, 0x03A1), (0x03A3, 0x03F5),
    (0x03F7, 0x0481), (0x048A, 0x052F), (0x0531, 0x0556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD),
    (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC),
    (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124),
    (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F),
    (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E),
    (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)
# DeepSeek LLM (v1/v2): letters of cased scripts, ASCII/full-width punctuation, CJK runs and digit runs are split
# out one after the other.
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + "".join(f"\\x{{{a:x}}}-\\x{{{b:x}}}" for a, b in _DEEPSEEK_LETTERS) + "]+",
    r"\s?[!-/:-~\x{ff01}-\x{ff0f}\x{ff1a}-\x{ff5e}\x{2018}-\x{201f}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+",
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+",
                   r"\p{N}")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_BAILING = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)"
            r"|\s+")
# llama.cpp's fallback for a BPE vocabulary whose pre-tokenizer is "default" or unknown
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not split (Llama 3's tokenizer.json)
    nfc: bool = False  # NFC-normalize text first (Qwen2's tokenizer.json)
    add_bos: bool = False  # llama.cpp's default for tokenizer.ggml.add_bos_token when the key is absent


_P_GPT2 = PreTokenizer((_GPT2,))
_P_LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_P_QWEN2 = PreTokenizer((_QWEN2,), nfc=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    "gpt-2": _P_GPT2, "phi-2": _P_GPT2, "gigachat": _P_GPT2, "jina-es": _P_GPT2, "jina-de": _P_GPT2,
    "mpt": _P_GPT2, "olmo": _P_GPT2, "jais": _P_GPT2, "exaone4": _P_GPT2, "roberta-bpe": _P_GPT2,
    "llama3": _P_LLAMA3, "llama-v3": _P_LLAMA3, "llama-bpe": _P_LLAMA3, "falcon3": _P_LLAMA3,
    "falcon-h1": _P_LLAMA3, "pixtral": _P_LLAMA3, "midm-2.0": _P_LLAMA3, "lfm2": _P_LLAMA3,
    "dbrx": PreTokenizer((_LLAMA3,)), "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "glm4": PreTokenizer((_LLAMA3,)), "chatglm-bpe": PreTokenizer((_LLAMA3,)),
    "qwen2": _P_QWEN2, "deepseek-r1-qwen": _P_QWEN2, "megrez": PreTokenizer((_QWEN2,)),
    "stablelm2": PreTokenizer((_QWEN2,)), "hunyuan": PreTokenizer((_QWEN2,)), "grok-2": PreTokenizer((_QWEN2,)),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),
    "deepseek-v3": PreTokenizer(_DEEPSEEK_V3), "hunyuan-dense": PreTokenizer(_DEEPSEEK_V3),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)), "refact": PreTokenizer((r"\p{N}", _GPT2)),
    "command-r": PreTokenizer((r"\p{N}", _GPT2)), "smollm": PreTokenizer((r"\p{N}", _GPT2)),
    "gpt-4o": PreTokenizer((_GPT4O,)), "llama4": PreTokenizer((_GPT4O,)), "minimax-m2": PreTokenizer((_GPT4O,)),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
    "bailingmoe": PreTokenizer((_BAILING,)), "bailingmoe2": PreTokenizer((_BAILING,)),
}

# Token texts that end a turn (llama.cpp's end-of-generation list), besides the GGUF's eos/eot/eom ids.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>")  # the last is DeepSeek's <｜end▁of▁sentence｜>


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    # printable Latin-1 bytes stand for themselves; the other 68 bytes are moved up to U+0100 and beyond, in order
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
_SPM_SPACE = "\u2581"  # ▁
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# --------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode text with a GGUF vocabulary. Build with ``Tokenizer.from_metadata(md)``."""

    def __init__(self, md: dict[str, Any]):
        import tokenizers
        from tokenizers import models, normalizers, pre_tokenizers

        self.model = str(md.get("tokenizer.ggml.model", ""))
        self.pre = str(md.get("tokenizer.ggml.pre", "default"))
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise StrataError("GGUF has no tokenizer.ggml.tokens: no vocabulary to tokenize with")
        self._tokens: list[str] = list(tokens)
        n = len(self._tokens)
        types = md.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * n
        if len(types) != n:
            raise StrataError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        self._types = [int(t) for t in types]

        def opt_id(key: str) -> int | None:
            v = md.get(key)
            return int(v) if v is not None and 0 <= int(v) < n else None

        self.bos_id = opt_id("tokenizer.ggml.bos_token_id")
        self.eos_id = opt_id("tokenizer.ggml.eos_token_id")
        self.pad_id = opt_id("tokenizer.ggml.padding_token_id")
        self.unk_id = opt_id("tokenizer.ggml.unknown_token_id")
        self.eot_id = opt_id("tokenizer.ggml.eot_token_id")
        self.eom_id = opt_id("tokenizer.ggml.eom_token_id")

        self._vocab: dict[str, int] = {}
        for i, t in enumerate(self._tokens):
            self._vocab.setdefault(t, i)

        if self.model == "gpt2":
            pre = PRE_TOKENIZERS.get(self.pre)
            if pre is None:
                log.warning("strata: unknown tokenizer.ggml.pre %r: using llama.cpp's default BPE pre-tokenizer",
                            self.pre)
                pre = PRE_TOKENIZERS["default"]
            self._pre = pre
            merges = []
            for m in md.get("tokenizer.ggml.merges") or []:
                sep = m.find(" ", 1)
                if sep < 0:
                    raise StrataError(f"bad merge {m!r} in tokenizer.ggml.merges")
                merges.append((m[:sep], m[sep + 1:]))
            bpe = models.BPE(vocab=self._vocab, merges=merges, ignore_merges=pre.ignore_merges)
            hf = tokenizers.Tokenizer(bpe)
            if pre.nfc:
                hf.normalizer = normalizers.NFC()
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            self.add_space_prefix = False
            default_add_bos = pre.add_bos
        elif self.model == "llama":
            self._pre = None
            scores = md.get("tokenizer.ggml.scores") or [0.0] * n
            merges = _spm_merges(self._tokens, self._types, scores, self._vocab)
            unk = self._tokens[self.unk_id] if self.unk_id is not None else None
            bpe = models.BPE(vocab=self._vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
            hf = tokenizers.Tokenizer(bpe)  # no pre-tokenizer: SentencePiece sees each text run as one word
            self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            default_add_bos = True
        else:
            raise StrataError(f"unsupported tokenizer.ggml.model {self.model!r} (strata supports 'gpt2' and 'llama')")
        self._hf = hf
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)) and self.bos_id is not None
        self.add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None

        T = TokenType
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in enumerate(self._types) if t in (T.CONTROL, T.UNKNOWN))
        self._piece_bytes = [self._token_bytes(i) for i in range(n)]
        self._split_all = _alternation([self._tokens[i] for i in range(n)
                                        if self._types[i] in (T.CONTROL, T.USER_DEFINED, T.UNKNOWN)])
        self._split_user = _alternation([self._tokens[i] for i in range(n) if self._types[i] == T.USER_DEFINED])

        eot = {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        eot.update(self._vocab[t] for t in EOG_TEXTS if t in self._vocab)
        if "<|return|>" in self._vocab and "<|call|>" in self._vocab and "<|end|>" in self._vocab:
            eot.discard(self._vocab["<|end|>"])  # harmony format: <|end|> closes a message, not the generation
        self.eot_ids: frozenset[int] = frozenset(eot)

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
        return cls(md)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        return cls(read_gguf_metadata(path))

    # ---- vocabulary

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_piece(self, i: int) -> str:
        """The token's text as stored in the vocabulary (byte-level / ``▁``-escaped form)."""
        return self._tokens[i]

    def piece_to_id(self, piece: str) -> int | None:
        return self._vocab.get(piece)

    def token_type(self, i: int) -> TokenType:
        return TokenType(self._types[i])

    def token_bytes(self, i: int) -> bytes:
        """The bytes the token stands for in decoded text (special tokens: their text)."""
        return self._piece_bytes[i]

    def _token_bytes(self, i: int) -> bytes:
        text, typ = self._tokens[i], self._types[i]
        if typ in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
            return text.encode("utf-8")
        if self.model == "gpt2":
            try:
                return bytes(_BYTE_DECODER[c] for c in text)
            except KeyError:  # not byte-level text: take it literally
                return text.encode("utf-8")
        if typ == TokenType.BYTE:
            m = _BYTE_PIECE.fullmatch(text)
            if m:
                return bytes([int(m.group(1), 16)])
        return text.replace(_SPM_SPACE, " ").encode("utf-8")

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """No token of ``encode(text)`` stands for more than this many bytes of ``text`` (UTF-8), so a text of B
        bytes has at least B / max_token_bytes tokens; None when no such bound holds. Lets a server refuse a text
        far past its context without tokenizing it. Computed once (a pass over the vocabulary)."""
        longest = max(4, max((len(b) for b in self._piece_bytes), default=0))  # (4: one character, whatever it is)
        if self.model == "llama":
            # a character missing from the vocabulary falls back to byte tokens; without all 256 of them it becomes
            # <unk>, and fused unknown characters make one token of any length
            if self.unk_id is not None and any(f"<0x{b:02X}>" not in self._vocab for b in range(256)):
                return None
            return longest
        # NFC may compose up to 3 code points into one (Hangul L+V+T jamo: 9 bytes -> 3), so the text a token
        # covers may be up to 3x its own bytes
        return longest * 3 if self._pre.nfc else longest

    # ---- encode / decode

    def encode(self, text: str, add_special: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        add_special: None adds BOS/EOS as the GGUF says (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``);
        True always adds BOS (when the vocabulary has one) and EOS where the GGUF asks for it; False adds none.
        parse_special: match control tokens such as ``<|im_start|>`` in the text (user-defined tokens always are).
        """
        add_bos = self.add_bos if add_special is None else (add_special and self.bos_id is not None)
        add_eos = self.add_eos if add_special is None else (add_special and self.add_eos)
        out: list[int] = [self.bos_id] if add_bos else []
        splitter = self._split_all if parse_special else self._split_user
        prev_special = True  # SentencePiece prefixes a space to the text at the start and after a special token
        pos = 0
        for m in (splitter.finditer(text) if splitter is not None else ()):
            if m.start() > pos:
                self._encode_run(text[pos:m.start()], prev_special, out)
            out.append(self._vocab[m.group()])
            prev_special = True
            pos = m.end()
        if pos < len(text):
            self._encode_run(text[pos:], prev_special, out)
        if add_eos:
            out.append(self.eos_id)
        return out

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: special tokens parsed, BOS added as the GGUF says unless the text already
        starts with it (templates such as Llama 3's write ``{{ bos_token }}`` themselves)."""
        starts_with_bos = self.bos_id is not None and text.startswith(self._tokens[self.bos_id])
        return self.encode(text, add_special=False if starts_with_bos else None, parse_special=True)

    def _encode_run(self, text: str, prev_special: bool, out: list[int]) -> None:
        if self.model == "llama":
            if self.add_space_prefix and prev_special:
                text = " " + text
            text = text.replace(" ", _SPM_SPACE)
        out.extend(self._hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. ``skip_special`` drops control tokens (BOS, EOS, ...)."""
        parts = []
        for i in ids:
            i = int(i)
            if skip_special and i in self.special_ids:
                continue
            b = self._piece_bytes[i]
            if not parts and self.add_space_prefix and b[:1] == b" ":
                b = b[1:]  # undo the space SentencePiece prefixed to the text
            parts.append(b)
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Incremental detokenization for streaming output.

    ``put(id)`` returns the new text, never a partial UTF-8 character (bytes of an unfinished character wait for
    the next tokens); ``flush()`` returns what is left at the end. The concatenation of everything returned is
    exactly ``tokenizer.decode(ids, skip_special)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def put(self, token_id: int) -> str:
        tok = self.tokenizer
        token_id = int(token_id)
        if self.skip_special and token_id in tok.special_ids:
            return ""
        b = tok._piece_bytes[token_id]
        if self._first:
            self._first = False
            if tok.add_space_prefix and b[:1] == b" ":
                b = b[1:]
        return self._utf8.decode(b)

    def put_many(self, ids: Sequence[int]) -> str:
        return "".join(self.put(i) for i in ids)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# --------------------------------------------------------------------------------------------------------------


def _alternation(texts: list[str]) -> re.Pattern | None:
    """One regex matching any of ``texts``, the longest at a given position."""
    texts = sorted({t for t in texts if t}, key=lambda t: (-len(t), t))
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _spm_merges(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float],
                vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scored merging.

    SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is the highest-scoring vocabulary
    piece. Listing every split (a, b) of every mergeable piece, ordered by the piece's score (descending), gives
    a rank table with which ordinary BPE makes the same choices.
    """
    mergeable = (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNDEFINED)
    cands = []
    for i, t in enumerate(tokens):
        if types[i] not in mergeable or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is None or ib is None:
                continue
            if types[ia] not in mergeable or types[ib] not in mergeable:
                continue
            cands.append((-float(scores[i]), i, ia, ib, a, b))
    cands.sort(key=lambda c: c[:4])
    return [(c[4], c[5]) for c in cands]
