"""StopStringMatcher, scanned token by token, against decoding the whole generated text every step."""

from __future__ import annotations

import pytest
from megatron_tir.rollout.engines.stop import StopStringMatcher
from transformers import AutoTokenizer

TEXT = (
    "Let me compute it.\n```python\nimport math\nprint(math.comb(10, 3))\n```\n"
    "```output\n120\n```\nSo the answer is \\boxed{120} 😀 — done → ok<|im_end|>"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def scan(matcher, ids):
    for i in range(len(ids)):
        if (matched := matcher.check(ids[: i + 1])) is not None:
            return i, matched
    return None, None


def reference(tokenizer, ids, stops):
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return i, min(hits)[1]
    return None, None


@pytest.mark.parametrize("stops", [
    ("```\n",), ("```output",), ("\\boxed{",), ("😀",), ("→ ok",), ("<|im_end|>",), ("(10, 3))\n``",),
    ("not in the text",), ("```output", "```\n"), ("print(", "import"),
])
def test_first_match_equals_full_text_reference(tokenizer, stops):
    ids = tokenizer(TEXT).input_ids
    assert scan(StopStringMatcher(tokenizer, stops), ids) == reference(tokenizer, ids, stops)


def test_emoji_spans_several_byte_tokens(tokenizer):
    ids = tokenizer(" 😀").input_ids
    assert len(ids) > 1  # the stop string is completed by the last byte token only
    assert scan(StopStringMatcher(tokenizer, ("😀",)), ids) == (len(ids) - 1, "😀")


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(tokenizer, ("```", ""))
