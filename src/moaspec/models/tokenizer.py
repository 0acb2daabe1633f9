"""The model's tokenizer and chat template without transformers: a `tokenizers` BPE (built from the GGUF's
vocabulary by `gguf_file.build_tokenizer`, or a Hugging Face folder's tokenizer.json) and the template rendered
in a sandboxed jinja2, as transformers renders it. It offers the few calls of transformers' tokenizers that
the project makes, so importing the runtime never imports transformers (~3 s of every start).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from moaspec.errors import UserError


def _environment():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own filter escapes HTML characters, which a prompt must keep as they are
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


class Tokenizer:
    """Encode, decode and render chats for one model folder (tokenizer.json, tokenizer_config.json and the chat
    template)."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        try:
            self._tok = Backend.from_file(str(folder / "tokenizer.json"))
            config = json.loads((folder / "tokenizer_config.json").read_text()) \
                if (folder / "tokenizer_config.json").is_file() else {}
        except (OSError, ValueError, Exception) as e:  # tokenizers raises its own Exception type
            raise UserError(f"cannot read the tokenizer in {folder} ({e}); delete the folder and run again") from e
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else config.get("chat_template")
        self._special = {k: self._name(config.get(f"{k}_token")) for k in ("bos", "eos", "pad", "unk")}
        self._template = None

    @staticmethod
    def _name(value) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    def _id(self, kind: str) -> int | None:
        name = self._special[kind]
        return None if name is None else self._tok.token_to_id(name)

    bos_token = property(lambda self: self._special["bos"])
    eos_token = property(lambda self: self._special["eos"])
    bos_token_id = property(lambda self: self._id("bos"))
    eos_token_id = property(lambda self: self._id("eos"))
    pad_token_id = property(lambda self: self._id("pad"))
    unk_token_id = property(lambda self: self._id("unk"))

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as its JSON (what a grammar engine builds its vocabulary from)."""
        return self._tok.to_str()

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def tokenize(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens: bool = False) -> list[str]:
        return self._tok.decode_batch([[int(i) for i in s] for s in seqs], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            found = self._tok.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str | list[int]:
        """The chat rendered with the model's template (and its token ids unless `tokenize=False`)."""
        if not self.chat_template:
            raise UserError("this model has no chat template; use --no-chat (the prompt as it is)")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        names = {f"{k}_token": v for k, v in self._special.items() if v is not None}
        text = self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **names, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        config = {f"{k}_token": v for k, v in self._special.items()}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        if self.chat_template:
            (folder / "chat_template.jinja").write_text(self.chat_template)
