"""gpt-oss's harmony format: the real chat template renders, and the output's analysis channel is the reasoning."""

import pytest

from strata.gguf.chat_template import ChatTemplate
from strata.reasoning import HarmonySplitter, uses_harmony

OUT = ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
       "It is 4.")


def _split(text: str, enabled: bool = True, by_char: bool = False) -> tuple[str, str]:
    s = HarmonySplitter(enabled)
    got = [s.push(ch) for ch in text] if by_char else [s.push(text)]
    got.append(s.flush())
    return "".join(r for r, _ in got), "".join(c for _, c in got)


@pytest.mark.parametrize("by_char", [False, True])
@pytest.mark.parametrize("text,expected", [
    (OUT, ("User asks 2+2. Easy.", "It is 4.")),
    (OUT + "<|return|>", ("User asks 2+2. Easy.", "It is 4.")),
    ("<|channel|>final<|message|>Just the answer.", ("", "Just the answer.")),
    ("<|channel|>analysis<|message|>cut off mid tho", ("cut off mid tho", "")),
    ("plain text, no header", ("", "plain text, no header")),
    ("<|channel|>analysis<|message|>a <| b<|end|><|channel|>final<|message|>c", ("a <| b", "c")),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": 1}<|call|>", ("", "{\"x\": 1}")),
])
def test_harmony_split(text, expected, by_char):
    assert _split(text, by_char=by_char) == expected


def test_harmony_disabled_passes_text():
    assert _split(OUT, enabled=False) == ("", OUT)


def test_real_gpt_oss_template_renders(llamacpp_models):
    source = (llamacpp_models / "templates" / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    assert uses_harmony(source)
    assert not uses_harmony((llamacpp_models / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
    t = ChatTemplate(source, bos_token="<|startoftext|>", eos_token="<|return|>", name="openai-gpt-oss-120b.jinja")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "simple sum"}, {"role": "user", "content": "3+3?"}]
    text = t.render(msgs, add_generation_prompt=True)
    assert text.endswith("<|start|>assistant")
    assert "<|channel|>final<|message|>4" in text and "3+3?" in text
