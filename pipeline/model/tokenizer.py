"""Text <-> token ids and chat templates, from a GGUF file's vocabulary or a Hugging Face tokenizer.json.

Built on the `tokenizers` library. Encoding never adds a BOS unless asked (`add_special_tokens=True`)
and the checkpoint says it wants one. Chat templates are the model's own Jinja2 templates.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pipeline.model.config import read_json
from pipeline.model.gguf_format import GGUFFile

# GGUF token types (llama.cpp's llama_token_type): control and user-defined tokens are added tokens.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# GGUF `tokenizer.ggml.pre` names whose splitting we reproduce; each is a pre-tokenizer on top of
# GPT-2's byte-level regex. `smollm` isolates every numeric character before the GPT-2 split.
_GGUF_PRE_TOKENIZERS = {
    "gpt2": [],
    "default": [],
    "smollm": [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")],
}


class IncrementalDecoder:
    """Turns generated ids into text one token at a time, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """New text made complete by `token_id` ('' while a multi-byte character is still partial)."""
        return self._stream.step(self._tokenizer, int(token_id)) or ""


class Tokenizer:
    """A model's tokenizer: `encode`, `decode`, `apply_chat_template`, special ids, streaming decode."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        source: str,
    ):
        self.hf = hf
        self.source = source
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._template = _compile_template(chat_template, source) if chat_template else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Encode many strings at once (the `tokenizers` library parallelises this in Rust)."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self.hf, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role", "content"}, ...]) into prompt text with the chat template.

        `kwargs` reach the template as variables (e.g. `enable_thinking`, `tools`), over `bos_token` and
        `eos_token`, as in Hugging Face's `apply_chat_template`."""
        if self._template is None:
            raise ValueError(f"{self.source} defines no chat template; pass raw prompts instead")
        bos = self.hf.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.hf.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(
            **{"bos_token": bos, "eos_token": eos, **kwargs},
            messages=list(messages), add_generation_prompt=add_generation_prompt,
        )

    def with_chat_template(self, template: str, origin: str) -> Tokenizer:
        """This tokenizer rendering with `template` (Jinja source, compiled sandboxed) instead of the model's
        own; `origin` names it in errors. Raises ValueError when it does not compile."""
        other = copy.copy(self)
        other.chat_template = template
        other._template = _compile_template(template, origin)
        return other

    # ----------------------------------------------------------------------------------- loaders

    @classmethod
    def from_gguf(cls, path: str | Path, metadata: dict | None = None) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (BPE vocab, merges, special tokens, chat template).

        `metadata` is the file's already parsed key/values, to avoid reading it twice.
        """
        path = str(path)
        metadata = metadata if metadata is not None else GGUFFile(path).metadata

        def field(key: str, default=None):
            return metadata.get(key, default)

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model={kind!r} is not supported (expected 'gpt2', a byte-level BPE)"
            )
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise ValueError(
                f"{path}: tokenizer.ggml.pre={pre!r} is not supported (known: {sorted(_GGUF_PRE_TOKENIZERS)})"
            )
        tokens: list[str] | None = field("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{path}: metadata has no tokenizer.ggml.tokens (no vocabulary in this GGUF)")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        types = field("tokenizer.ggml.token_type", [1] * len(tokens))
        hf = HFTokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        )
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*_GGUF_PRE_TOKENIZERS[pre], pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind in zip(tokens, types)
                if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
            ]
        )
        bos = field("tokenizer.ggml.bos_token_id")
        if field("tokenizer.ggml.add_bos_token", False) and bos is not None:
            bos_text = tokens[bos]
            hf.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A", pair=f"{bos_text} $A $B", special_tokens=[(bos_text, bos)]
            )
        eos = [field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return cls(
            hf,
            chat_template=field("tokenizer.chat_template"),
            bos_token_id=bos,
            eos_token_ids=[e for e in eos if e is not None],
            source=path,
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus `tokenizer_config.json` (special tokens, chat template) from a
        Hugging Face model directory; `generation_config.json` may add end-of-sequence ids."""
        directory = Path(directory)
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: a Hugging Face model directory needs tokenizer.json"
            )
        hf = HFTokenizer.from_file(str(tok_file))
        cfg, gen, model_cfg = (read_json(f) if f.is_file() else {} for f in (  # all three are optional
            directory / "tokenizer_config.json", directory / "generation_config.json", directory / "config.json"))

        def token_id(value) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                return None
            tid = hf.token_to_id(value)
            if tid is None:
                raise ValueError(
                    f"{directory / 'tokenizer_config.json'}: token {value!r} is not in {tok_file}"
                )
            return tid

        bos = token_id(cfg.get("bos_token"))
        if bos is None:
            bos = model_cfg.get("bos_token_id")
        eos: list[int] = []
        for source in (
            token_id(cfg.get("eos_token")),
            gen.get("eos_token_id"),
            model_cfg.get("eos_token_id"),
        ):
            eos.extend(source if isinstance(source, list) else [] if source is None else [source])
        return cls(
            hf,
            chat_template=_hf_chat_template(directory, cfg),
            bos_token_id=bos,
            eos_token_ids=eos,
            source=str(directory),
        )


def _hf_chat_template(directory: Path, cfg: dict) -> str | None:
    """The default chat template: `chat_template.jinja`, else tokenizer_config.json's `chat_template`
    (a string, or a list of named templates of which we take 'default')."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile_template(source_text: str, origin: str) -> jinja2.Template:
    """Compile a chat template the way Hugging Face renders them (sandboxed, trimmed blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: chat template does not compile: {e}") from e
