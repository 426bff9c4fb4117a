"""The GGUF-built tokenizer against transformers' tokenizer of the same GGUF file.

transformers does not know the `smollm` pre-tokenizer (it falls back to GPT-2 splitting), so the reference
for text with numeric characters is: cut the text around every Unicode number character (category N*),
encode each piece with transformers, concatenate. That is the rule llama.cpp applies for `smollm`.
"""

from __future__ import annotations

import itertools
import random
import unicodedata

import pytest

from pipeline.model.tokenizer import Tokenizer

BASE_STRINGS = [
    "Hello world",
    "hello, World! How are you?",
    " leading space",
    "trailing space ",
    "  two leading",
    "two trailing  ",
    "\n",
    "\n\n\n",
    " \n \n",
    "\t tab\tseparated\t",
    "line one\nline two\r\nline three",
    "",
    " ",
    "     ",
    "I'm, you're, they've, we'll, she'd, it's",
    "UPPER lower MiXeD",
    "naïve café résumé façade",
    "Ελληνικά και русский язык",
    "日本語のテキストです。",
    "中文字符测试，包括标点符号！",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "שלום עולם",
    "हिन्दी पाठ",
    "🤖🚀🎉 emoji galore 😀😃😄",
    "family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, skin: 👍🏽",
    "zero\u200bwidth\u200djoiner",
    "math: ∑∫∂√∞ ≤ ≥ ≠ ±",
    "quotes “smart” ‘single’ «guillemets»",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '<div class="x">text</div>',
    "SELECT * FROM users WHERE id = 42;",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "https://example.com/path?query=1&b=2#frag",
    "email@example.org",
    "snake_case camelCase kebab-case",
    "....!!!???,,,;;;",
    "---===+++***",
    "    indented code\n        more",
    "1",
    "12",
    "123456789",
    "3.14159",
    "10  11",
    "x10  11 y",
    "2024-05-17 13:45:00",
    "+1 (555) 012-3456",
    "½ ¼ ¾",
    "x² + y³ = z⁴",
    "٣ ٤ ٥ arabic-indic digits",
    "Ⅷ roman numeral, ① circled",
    "一二三 CJK numerals",
    "version v1.2.3-rc4",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<repo_name>my/repo<file_sep>main.py",
    "a<|im_start|>b<|im_end|>c<|endoftext|>d",
    "<|im_start|> spaced <|im_end|>",
    "<|not_special|>",
    "The quick brown fox jumps over the lazy dog.",
    "Supercalifragilisticexpialidocious",
    "antidisestablishmentarianism",
    "a" * 50,
    "ab " * 20,
    "\u00a0non-breaking\u00a0space",
    "control\x07bell\x1bescape",
    "null\x00byte",
]


def _ref_encode(ref, text: str) -> list[int]:
    """The smollm rule on top of transformers: every number character is a piece of its own."""
    pieces, current = [], ""
    for ch in text:
        if unicodedata.category(ch).startswith("N"):
            pieces += [current, ch]
            current = ""
        else:
            current += ch
    pieces.append(current)
    return [i for p in pieces if p for i in ref.encode(p, add_special_tokens=False)]


def _all_strings() -> list[str]:
    rng = random.Random(0)
    combos = [a + b for a, b in itertools.combinations(BASE_STRINGS[:40], 2)]
    rng.shuffle(combos)
    alphabet = "ab c1 2\n é世🤖½_<|>'"
    noise = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(60)]
    return BASE_STRINGS + combos[:120] + noise


STRINGS = _all_strings()


@pytest.fixture(scope="module")
def tok(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def ref(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def test_enough_varied_strings():
    assert len(STRINGS) >= 200
    assert any(any(unicodedata.category(c).startswith("N") for c in s) for s in STRINGS)


@pytest.mark.slow  # transformers parses the 49k-token GGUF vocabulary slowly (10-60 s here)
def test_ids_match_reference(tok, ref):
    mismatches = [
        (s, tok.encode(s), _ref_encode(ref, s)) for s in STRINGS if tok.encode(s) != _ref_encode(ref, s)
    ]
    assert not mismatches, mismatches[:3]


def test_round_trip(tok):
    bad = [s for s in STRINGS if tok.decode(tok.encode(s), skip_special_tokens=False) != s]
    assert not bad


def test_every_digit_is_its_own_token(tok):
    for text in ["10  11", "2024", "x² ½ ٣", "a123b"]:
        for token in tok.encode(text):
            piece = tok.decode([token])
            if any(unicodedata.category(c).startswith("N") for c in piece):
                assert len(piece) == 1, (text, piece)
    assert [tok.decode([t]) for t in tok.encode("123")] == ["1", "2", "3"]


def test_special_tokens_and_no_bos(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.vocab_size == 49152
    assert tok.encode("<|im_start|>user<|im_end|><|endoftext|>") == [1, 4093, 2, 0]
    assert tok.encode("Hello")[0] != tok.bos_token_id
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello")  # the GGUF wants no BOS
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


@pytest.mark.slow
def test_chat_template_matches_reference(tok, ref):
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "user", "content": "Tell me a joke"},
            {"role": "assistant", "content": "Why did the chicken cross the road?"},
            {"role": "user", "content": "Why? 🐔\n"},
        ],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("text", ["a🤖b 世界 é", "👨‍👩‍👧‍👦 family", "日本語のテキスト", "plain ascii text"])
def test_incremental_decode_is_streaming_safe(tok, text):
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    chunks = [decoder.push(i) for i in ids]
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    if len(ids) > len(text):  # some character spans several tokens: its first tokens emit nothing
        assert "" in chunks


def test_incremental_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    decoder = tok.incremental_decoder()
    assert "".join(decoder.push(i) for i in ids) == "assistant\nHi there"


def test_hf_dir_tokenizer_equals_gguf_tokenizer(tok, tiny_model_dir):
    hf = Tokenizer.from_hf_dir(tiny_model_dir)
    assert hf.bos_token_id == tok.bos_token_id and hf.eos_token_ids == tok.eos_token_ids
    assert all(hf.encode(s) == tok.encode(s) for s in STRINGS[:100])
    messages = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
