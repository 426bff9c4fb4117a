"""Rows -> prompt tokens: templates, system prompts, truncation, per-row sampling, and error rows.

The reference for rendered prompts is the ChatML format written out by hand, encoded by the
model's tokenizer: the builder must produce exactly those tokens.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import SAMPLING_COLUMNS, InputConfig
from pipeline.engine.request import SamplingParams
from pipeline.model.tokenizer import Tokenizer
from pipeline.source.prompts import PromptBuilder

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_model_dir)


def builder(tokenizer, max_model_len=2048, max_tokens=16, **inp) -> PromptBuilder:
    """A builder that reads every sampling column (the job reads only the default few unless told)."""
    inp.setdefault("sampling_columns", list(SAMPLING_COLUMNS))
    return PromptBuilder(tokenizer, InputConfig(**inp), SamplingParams(max_tokens=max_tokens), max_model_len)


def test_plain_prompt_as_user_turn(tokenizer):
    p = builder(tokenizer).prepare({"prompt": "What is 2 + 2?"})
    assert p.error is None
    assert p.token_ids == tokenizer.encode(chatml(("system", DEFAULT_SYSTEM), ("user", "What is 2 + 2?")))
    assert p.prompt_tokens == len(p.token_ids) and p.sampling == SamplingParams(max_tokens=16)


def test_system_prompt_and_raw_prompt(tokenizer):
    with_system = builder(tokenizer, system_prompt="Be brief.").prepare({"prompt": "Hi"})
    assert with_system.token_ids == tokenizer.encode(chatml(("system", "Be brief."), ("user", "Hi")))
    raw = builder(tokenizer, chat_template=False).prepare({"prompt": "Once upon a time"})
    assert raw.token_ids == tokenizer.encode("Once upon a time")
    raw_system = builder(tokenizer, chat_template=False, system_prompt="Story:").prepare({"prompt": "Once"})
    assert raw_system.token_ids == tokenizer.encode("Story:\n\nOnce")


def test_messages_keep_their_own_system_turn(tokenizer):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    b = builder(tokenizer, messages_column="messages", system_prompt="ignored when the row has one")
    expected = tokenizer.encode(chatml(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")))
    assert b.prepare({"messages": msgs}).token_ids == expected
    assert b.prepare({"messages": json.dumps(msgs)}).token_ids == expected  # JSON text works too
    no_system = b.prepare({"messages": msgs[1:2]})
    assert no_system.token_ids == tokenizer.encode(chatml(("system", "ignored when the row has one"), ("user", "U1")))


def test_per_row_sampling_overrides(tokenizer):
    b = builder(tokenizer)
    p = b.prepare({"prompt": "x", "max_tokens": 5.0, "temperature": 0.8, "top_p": 0.9, "seed": 7})
    assert p.sampling == SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7)
    missing = {"prompt": "x", "max_tokens": None, "seed": None, "temperature": float("nan")}  # NaN: pandas' null
    assert b.prepare(missing).sampling == SamplingParams(max_tokens=16)
    off = builder(tokenizer, sampling_columns=[]).prepare({"prompt": "x", "temperature": 0.8})
    assert off.sampling.temperature == 0


def test_every_sampling_key_but_n_is_a_row_column(tokenizer):
    """Lists and maps come as Arrow gives them (lists, (key, value) pairs) or as JSON text."""
    row = {"prompt": "x", "top_k": 5.0, "min_p": 0.1, "stop": ["###"], "stop_token_ids": "[2, 3]",
           "ignore_eos": True, "logprobs": 2, "repetition_penalty": 1.2, "presence_penalty": -0.5,
           "frequency_penalty": 0.25, "logit_bias": [(7, -100.0), (9, 2.5)], "min_tokens": 3}
    p = builder(tokenizer).prepare(row)
    assert p.sampling == SamplingParams(
        max_tokens=16, top_k=5, min_p=0.1, stop=("###",), stop_token_ids=(2, 3), ignore_eos=True, logprobs=2,
        repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.25, logit_bias={7: -100.0, 9: 2.5},
        min_tokens=3)
    assert builder(tokenizer).prepare({"prompt": "x", "logit_bias": '{"7": 1}'}).sampling.logit_bias == {7: 1}


def test_only_the_default_sampling_columns_are_read_unless_named(tokenizer):
    """A dataset's own `choice` or `stop` column is data, not an override, unless input.sampling_columns names it."""
    row = {"prompt": "x", "temperature": 0.5, "choice": ["a", "b"], "stop": ["###"]}
    p = PromptBuilder(tokenizer, InputConfig(), SamplingParams(max_tokens=16), 2048).prepare(row)
    assert p.sampling == SamplingParams(max_tokens=16, temperature=0.5)


def test_truncate_left_keeps_the_prompt_end(tokenizer):
    text = " ".join(f"word{i}" for i in range(300))
    full = builder(tokenizer, chat_template=False).prepare({"prompt": text}).token_ids
    p = builder(tokenizer, max_model_len=100, max_tokens=20, chat_template=False, truncate="left").prepare(
        {"prompt": text})
    assert p.error is None and p.token_ids == full[-80:] and p.prompt_tokens == 80


ROW_ERRORS = [
    ({"prompt": None}, {}, "prompt is null"),
    ({"prompt": ""}, {}, "prompt is empty"),
    ({"prompt": "  \n\t"}, {}, "prompt is empty"),
    ({"prompt": "word " * 200}, {"max_model_len": 100}, "prompt has 2"),
    ({"prompt": "x"}, {"max_model_len": 16}, "max_tokens=16 leaves no room"),
    ({"prompt": "x", "temperature": -0.5}, {}, "bad per-row sampling value in column "
                                                "'temperature': invalid sampling parameters: "
                                                "temperature must be a finite number >= 0"),
    ({"prompt": "x", "temperature": 0.5, "presence_penalty": 3}, {}, "in column 'presence_penalty': "),
    ({"prompt": "x", "repetition_penalty": 0}, {}, "in column 'repetition_penalty': "),
    ({"prompt": "x", "logit_bias": "{oops"}, {}, "in column 'logit_bias': not valid JSON"),
    ({"prompt": "x", "logit_bias": [(3, 101.0)]}, {}, "logit_bias must map token ids >= 0 to numbers in [-100, 100]"),
    ({"prompt": "x", "stop": "###"}, {}, "in column 'stop': not valid JSON"),
    ({"prompt": "x", "stop_token_ids": '{"a": 1}'}, {}, "in column 'stop_token_ids': expected a list, got dict"),
    ({"prompt": "x", "min_tokens": 17}, {}, "in column 'min_tokens': "),
    ({"prompt": "x", "ignore_eos": "yes"}, {}, "in column 'ignore_eos': "),
    ({"prompt": "x", "temperature": float("inf")}, {}, "temperature must be a finite number"),
    ({"prompt": "x", "max_tokens": 0}, {}, "max_tokens must be an integer >= 1"),
    ({"prompt": "x", "max_tokens": 2.5}, {}, "max_tokens must be an integer >= 1"),
    ({"prompt": "x", "top_p": 0}, {}, "top_p must be in (0, 1]"),
    ({"prompt": "x", "seed": -3}, {}, "seed must be a non-negative integer"),
    ({"messages": None}, {"messages_column": "messages"}, "messages is null"),
    ({"messages": []}, {"messages_column": "messages"}, "messages is an empty list"),
    ({"messages": "{not json"}, {"messages_column": "messages"}, "malformed messages: not valid JSON"),
    ({"messages": '{"role": "user"}'}, {"messages_column": "messages"}, "expected a list of {role, content}, got dict"),
    ({"messages": [{"content": "hi"}]}, {"messages_column": "messages"}, "malformed messages: item 0 has no role"),
    ({"messages": [None]}, {"messages_column": "messages"}, "malformed messages: item 0 has no role"),
    ({"messages": [{"role": "user", "content": None}]}, {"messages_column": "messages"},
     "item 0 (user) has no text content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, {"messages_column": "messages"},
     "unknown role 'wizard' in message 0"),
    ({"messages": [{"role": "user", "content": " "}]}, {"messages_column": "messages"},
     "messages have only empty content"),
]


@pytest.mark.parametrize("row, options, words", ROW_ERRORS)
def test_bad_rows_become_errors(tokenizer, row, options, words):
    p = builder(tokenizer, **options).prepare(row)
    assert p.token_ids is None and p.sampling is None
    assert words in p.error


def test_overlong_error_reports_the_numbers(tokenizer):
    p = builder(tokenizer, max_model_len=100, max_tokens=30, chat_template=False).prepare({"prompt": "word " * 200})
    assert p.error == (f"prompt has {p.prompt_tokens} tokens; max_model_len=100 - max_tokens=30 allows 70 "
                       f"(input.truncate=left keeps the last 70)")
    assert p.prompt_tokens == len(tokenizer.encode("word " * 200))


def test_template_failure_is_a_row_error(tokenizer):
    class Strict:
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise ValueError("conversation roles must alternate")

        encode = tokenizer.encode

    b = PromptBuilder(Strict(), InputConfig(), SamplingParams(), 2048)
    assert b.prepare({"prompt": "x"}).error == "chat template failed: conversation roles must alternate"


CUSTOM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% if shout %}!{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False, "shout": True}, {"enable_thinking": True}])
def test_custom_template_and_kwargs_match_transformers(tokenizer, hf_tokenizer, kwargs):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    p = builder(tokenizer, messages_column="messages", chat_template=CUSTOM_TEMPLATE,
                chat_template_kwargs=kwargs).prepare({"messages": messages})
    want = hf_tokenizer.apply_chat_template(messages, chat_template=CUSTOM_TEMPLATE, add_generation_prompt=True,
                                            tokenize=False, **kwargs)
    assert tokenizer.decode(p.token_ids, skip_special_tokens=False) == want
    assert p.token_ids == hf_tokenizer(want, add_special_tokens=False)["input_ids"]


def test_model_template_kwargs_match_transformers(tokenizer, hf_tokenizer):
    """The model's own template with extra variables, as transformers renders it."""
    p = builder(tokenizer, chat_template_kwargs={"unused": 1}).prepare({"prompt": "Hello"})
    want = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                            tokenize=False, unused=1)
    assert tokenizer.decode(p.token_ids, skip_special_tokens=False) == want


def test_template_from_a_local_or_fsspec_file(tokenizer, tmp_path):
    import fsspec

    expect = builder(tokenizer, chat_template=CUSTOM_TEMPLATE).prepare({"prompt": "Hello"}).token_ids
    (tmp_path / "t.jinja").write_text(CUSTOM_TEMPLATE)
    with fsspec.open("memory://templates/t.jinja", "w") as f:
        f.write(CUSTOM_TEMPLATE)
    for where in (str(tmp_path / "t.jinja"), "memory://templates/t.jinja"):
        assert builder(tokenizer, chat_template=where).prepare({"prompt": "Hello"}).token_ids == expect
    assert expect != builder(tokenizer).prepare({"prompt": "Hello"}).token_ids


def test_bad_custom_templates(tokenizer, tmp_path):
    from pipeline.errors import JobError

    with pytest.raises(JobError, match=r"input.chat_template.*cannot read template file"):
        builder(tokenizer, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(JobError, match=r"input.chat_template.*does not compile"):
        builder(tokenizer, chat_template="{% for %}")
    # still sandboxed: reaching Python internals is a row error, not code execution
    escape = builder(tokenizer, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    assert "chat template failed" in escape.prepare({"prompt": "x"}).error
