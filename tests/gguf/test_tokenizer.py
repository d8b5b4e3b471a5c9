"""strata's GGUF tokenizer against llama.cpp's test vectors (ids produced by the models' own HF tokenizers) and
against transformers on the tiny trained tokenizer."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from strata import StrataError
from strata.gguf.tokenizer import PRE_TOKENIZERS, StreamDecoder, Tokenizer, TokenType, read_gguf_metadata
from strata.gguf.tokenizer_hf import (detect_pre_tokenizer, hf_tokenizer_to_metadata, make_tiny_hf_tokenizer,
                                      write_tokenizer_metadata)

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMACPP_MODELS = pathlib.Path(os.environ.get("STRATA_TESTDATA", ROOT / "tests" / "data")) / "llama.cpp-models"

VOCABS = ["qwen2", "gpt-2", "llama-bpe", "llama-spm", "deepseek-llm"]


@functools.lru_cache(maxsize=None)
def vocab_tokenizer(name: str) -> Tokenizer:
    path = LLAMACPP_MODELS / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.skip(f"test data not found at {path}")
    return Tokenizer.from_metadata(read_gguf_metadata(path))


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    """Inputs separated by '\\n__ggml_vocab_test__\\n', one line of expected ids per input (as llama.cpp's
    test-tokenizer-0 reads them)."""
    raw = (LLAMACPP_MODELS / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    lines = (LLAMACPP_MODELS / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    inputs = raw.split("\n__ggml_vocab_test__\n")
    if inputs[-1] == "":
        inputs.pop()
    assert len(lines) >= len(inputs)
    return [(s, [int(x) for x in line.split()]) for s, line in zip(inputs, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_vectors(name):
    tok = vocab_tokenizer(name)
    vectors = read_vectors(name)
    assert len(vectors) > 40
    failed = []
    for text, want in vectors:
        # llama.cpp's test: add_special=false, parse_special=false
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != want:
            failed.append((text, got, want))
        assert tok.decode(got) == text
    assert not failed, failed[:3]


def test_bos_defaults():
    assert vocab_tokenizer("llama-bpe").encode("Hello")[0] == 128000  # llama-bpe: BOS by default
    assert vocab_tokenizer("llama-spm").encode("Hello") == [1, 15043]  # add_bos_token=true in the GGUF
    assert vocab_tokenizer("qwen2").encode("Hello") == vocab_tokenizer("qwen2").encode("Hello", add_special=False)
    assert vocab_tokenizer("llama-spm").encode("Hello", add_special=False) == [15043]
    assert vocab_tokenizer("deepseek-llm").encode("Hi", add_special=True)[0] == 100000


def test_special_tokens_qwen2():
    tok = vocab_tokenizer("qwen2")
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert ids[0] == 151644 and 151645 in ids
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n"
    assert tok.decode(ids, skip_special=True) == "user\nHi\n"
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert 151644 not in plain and tok.decode(plain) == "<|im_start|>user"
    assert {151643, 151645} <= tok.eot_ids and 151644 not in tok.eot_ids
    assert tok.eos_id == 151643 and tok.pad_id == 151643
    assert tok.piece_to_id("<|im_end|>") == 151645 and tok.id_to_piece(151645) == "<|im_end|>"
    assert tok.piece_to_id("no such piece") is None
    assert 151644 in tok.special_ids and tok.token_type(151644) == TokenType.CONTROL
    assert tok.vocab_size == 151936


def test_eot_llama3():
    tok = vocab_tokenizer("llama-bpe")
    assert {128001, 128009} <= tok.eot_ids  # <|end_of_text|>, <|eot_id|>
    assert tok.encode("<|start_header_id|>user<|end_header_id|>", add_special=False)[0] == 128006


def test_spm_space_prefix_after_special():
    tok = vocab_tokenizer("llama-spm")
    # SentencePiece prefixes a space to each text run that starts the text or follows a special token
    assert tok.encode("</s>Hello", add_special=False) == [2, 15043]
    assert tok.encode("Hello</s>", add_special=False) == [15043, 2]
    assert tok.decode([1, 15043], skip_special=True) == "Hello"
    assert tok.decode([1, 15043]) == "<s> Hello"


TRICKY = "Hi 🦙 there — 我想在apple工作 ½ naïve 😶‍🌫️\n\tend"


@pytest.mark.parametrize("name", VOCABS)
def test_stream_decoder(name):
    tok = vocab_tokenizer(name)
    ids = tok.encode(TRICKY, add_special=True)
    for skip in (False, True):
        dec = StreamDecoder(tok, skip_special=skip)
        pieces = [dec.put(i) for i in ids]
        tail = dec.flush()
        assert "".join(pieces) + tail == tok.decode(ids, skip_special=skip)
        assert all("\ufffd" not in p for p in pieces)  # never half a character
    # some tokens of this text really do hold part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_stream_decoder_invalid_utf8_flushes_replacement():
    tok = vocab_tokenizer("gpt-2")
    lead = tok.piece_to_id("\u00c3")  # the byte 0xC3 alone: the start of a 2-byte character
    assert tok.token_bytes(lead) == b"\xc3"
    dec = StreamDecoder(tok)
    assert dec.put(lead) == ""
    assert dec.flush() == "\ufffd" == tok.decode([lead])


def test_unknown_model_is_refused():
    with pytest.raises(StrataError, match="unsupported tokenizer.ggml.model"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(StrataError, match="no tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})


# ---- tiny HF tokenizer, conversion, GGUF round trip

PARAGRAPH = ("<|im_start|>system\nYou are strata.<|im_end|>\n<|im_start|>user\nHello, world! Experts 🚀 live in "
             "RAM; 12345 naïve café 我想在苹果工作.<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n"
             "def f(x):\n    return x  # don't\n<tool_call>\n{\"name\": \"f\"}\n</tool_call><|im_end|>")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_hf_tokenizer(tmp_path_factory.mktemp("tiny") / "tok")


def test_tiny_matches_transformers(tiny_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_dir))
    md = hf_tokenizer_to_metadata(tiny_dir)
    assert md["tokenizer.ggml.pre"] == "qwen2"
    tok = Tokenizer.from_metadata(md)
    assert tok.vocab_size == len(hf) == 2048
    want = hf.encode(PARAGRAPH, add_special_tokens=True)
    assert tok.encode(PARAGRAPH) == want
    assert tok.decode(want) == hf.decode(want) == PARAGRAPH
    assert tok.decode(want, skip_special=True) == hf.decode(want, skip_special_tokens=True)
    assert tok.eos_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_id is None
    ids = {t: tok.piece_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>", "<tool_call>")}
    assert {ids["<|im_end|>"], ids["<|endoftext|>"]} <= tok.eot_ids
    assert tok.token_type(ids["<think>"]) == TokenType.USER_DEFINED  # plain added token: shown in output
    assert ids["<think>"] not in tok.special_ids
    # the template is Qwen3's
    template = (LLAMACPP_MODELS / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    assert md["tokenizer.chat_template"] == template == hf.chat_template


def test_tiny_is_deterministic(tiny_dir, tmp_path):
    # another process, another hash seed: same bytes
    code = ("import sys; from strata.gguf.tokenizer_hf import make_tiny_hf_tokenizer; "
            "make_tiny_hf_tokenizer(sys.argv[1])")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "again")], check=True, env=env,
                   cwd=str(ROOT))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "again" / f).read_bytes() == (tiny_dir / f).read_bytes(), f


def test_tiny_custom_text(tmp_path):
    d = make_tiny_hf_tokenizer(tmp_path / "t", vocab_size=300, text="aaa bbb aaa bbb ccc")
    tok = Tokenizer.from_metadata(hf_tokenizer_to_metadata(d))
    assert tok.vocab_size == 300
    assert tok.decode(tok.encode("aaa zzz")) == "aaa zzz"
    with pytest.raises(StrataError):
        make_tiny_hf_tokenizer(tmp_path / "u", vocab_size=100)


def test_gguf_round_trip(tiny_dir, tmp_path):
    import gguf

    md = hf_tokenizer_to_metadata(tiny_dir)
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    write_tokenizer_metadata(w, md)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()

    back = read_gguf_metadata(path)
    for k, v in md.items():
        assert back[k] == v, k
    reader = gguf.GGUFReader(str(path))  # the reference reader agrees on values and types
    f = reader.fields
    assert f["tokenizer.ggml.tokens"].contents() == md["tokenizer.ggml.tokens"]
    assert f["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert f["tokenizer.ggml.eos_token_id"].types == [gguf.GGUFValueType.UINT32]
    assert f["tokenizer.ggml.add_bos_token"].types == [gguf.GGUFValueType.BOOL]
    assert f["tokenizer.chat_template"].contents() == md["tokenizer.chat_template"]
    assert Tokenizer.from_gguf(path).encode(PARAGRAPH) == Tokenizer.from_metadata(md).encode(PARAGRAPH)


def _save_hf(tmp_path, pre_tokenizer, normalizer=None, ignore_merges=False):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["some text to train on, 1234 and more text"],
                            trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_detect_pre_tokenizer(tmp_path):
    import tokenizers
    from tokenizers import pre_tokenizers

    # GPT-2's own byte-level pre-tokenizer (its built-in regex)
    assert detect_pre_tokenizer(_save_hf(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False))) == "gpt-2"
    # Llama 3's tokenizer.json pieces
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(tokenizers.Regex(llama3), "isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    assert detect_pre_tokenizer(_save_hf(tmp_path, seq, ignore_merges=True)) == "llama-bpe"
    odd = pre_tokenizers.Sequence([pre_tokenizers.Split(tokenizers.Regex(r"\d{5}"), "isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False)])
    with pytest.raises(StrataError, match="matches none"):
        detect_pre_tokenizer(_save_hf(tmp_path, odd))


def test_hf_conversion_errors(tmp_path):
    with pytest.raises(StrataError, match="no tokenizer.json"):
        hf_tokenizer_to_metadata(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Unigram", "vocab": []}}))
    with pytest.raises(StrataError, match="only byte-level BPE"):
        hf_tokenizer_to_metadata(tmp_path)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(pre):
    # a byte-only vocabulary (no merges) with each known pre-tokenizer: the regexes compile and lose no text
    from strata.gguf.tokenizer import bytes_to_unicode

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
          "tokenizer.ggml.tokens": list(bytes_to_unicode().values()), "tokenizer.ggml.merges": []}
    tok = Tokenizer.from_metadata(md)
    text = "Hello  world\n\n 3333 'll 我想在apple工作 🚀 Ünïcödé\t!"
    ids = tok.encode(text, add_special=False)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text


def _llama2_style_hf_dir(tmp_path):
    """A Llama-2-style tokenizer.json (BPE with byte fallback, ▁ spaces by the normalizer) built from the
    llama-spm GGUF vocabulary, the way transformers' converter builds one from a SentencePiece model."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, normalizers, processors

    from strata.gguf.tokenizer import _spm_merges

    md = read_gguf_metadata(LLAMACPP_MODELS / "ggml-vocab-llama-spm.gguf")
    tokens, types, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores, vocab), unk_token="<unk>",
                     byte_fallback=True, fuse_unk=True)
    hf = tokenizers.Tokenizer(bpe)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 1)])
    d = tmp_path / "llama2"
    d.mkdir()
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"}))
    return d, hf


def test_convert_sentencepiece_style(tmp_path):
    d, hf = _llama2_style_hf_dir(tmp_path)
    vectors = read_vectors("llama-spm")
    for text, want in vectors:  # the fixture is a faithful Llama 2 tokenizer
        assert hf.encode(text, add_special_tokens=False).ids == want, text
    md = hf_tokenizer_to_metadata(d)
    assert md["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.add_space_prefix" not in md
    assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.add_bos_token"] is True
    tok = Tokenizer.from_metadata(md)
    assert tok.token_type(13) == TokenType.BYTE and tok.token_type(0) == TokenType.UNKNOWN
    for text, want in vectors:
        assert tok.encode(text, add_special=False, parse_special=False) == want, text
        assert tok.decode(want) == hf.decode(want, skip_special_tokens=False)
    assert tok.encode("Hello</s>") == hf.encode("Hello</s>").ids


def test_encode_prompt_single_bos():
    tok = vocab_tokenizer("llama-bpe")
    rendered = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    ids = tok.encode_prompt(rendered)
    assert ids.count(128000) == 1 and ids[0] == 128000 and ids[1] == 128006
    assert tok.encode_prompt("<|start_header_id|>user")[:2] == [128000, 128006]  # BOS added when missing
    assert vocab_tokenizer("qwen2").encode_prompt("<|im_start|>user")[0] == 151644  # qwen adds none
