"""The tokenizer of a Hugging Face model folder, read with the ``tokenizers`` library and the
folder's chat template rendered with jinja2: what the reference backend asks of a tokenizer
(chat-format a prompt, encode, decode, the end and padding ids) without importing transformers,
which costs about a CPU-second in each process that only needs these.

The template is rendered as transformers renders it (a sandboxed environment, ``trim_blocks`` and
``lstrip_blocks``, the special tokens as variables), so a prompt comes out character for
character the same; ``tests/backends/reference/test_causal_lm.py`` checks that against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class ChatTokenizer:
    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path}: no {name} (not a model folder with a tokenizer)")
        try:
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception for a file it cannot read
            raise ValueError(f"{path}/tokenizer.json: {e}") from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            raise ValueError(f"{path}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos = self.special["eos_token"]
        if eos is None or self._tok.token_to_id(eos) is None:
            raise ValueError(f"{path}: tokenizer_config.json names no end token the vocabulary has")
        self.eos_token_id: int = self._tok.token_to_id(eos)
        pad = self.special["pad_token"]
        pad_id = self._tok.token_to_id(pad) if pad else None
        self.pad_token_id: int = self.eos_token_id if pad_id is None else pad_id  # no pad token: pad with the end
        self._template = _compile(template)

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v is not None})

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as it stands (no special tokens added: the template wrote them)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _compile(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
