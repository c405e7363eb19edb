"""Fine-tuning examples: read from a ``.jsonl`` file, and tokenized with the loss on the
responses only (torch is not imported; nor is transformers, whose tokenizer is passed in).

**Reading** (`read_examples`). One JSON object per line; blank lines are skipped. Each line is
one of two forms, told apart by its fields (the field names are configurable):

- a prompt/response pair: ``{"prompt": str, "response": str}`` (the prompt may be empty, the
  response may not);
- a chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
  with at least one assistant message, none of them empty.

Other fields of a line are ignored. A line that holds both forms is refused, as is every other
mistake: a ValueError with one line naming the file, the line number and what is wrong.

**Tokens** (`encode_examples`), with a Hugging Face ``transformers.PreTrainedTokenizerBase``
(`load_tokenizer` reads one from a checkpoint folder):

- A prompt/response pair is ``[leading specials] + prompt + response + [eos]``: the specials the
  tokenizer itself puts before a text (BOS for Llama-style tokenizers, nothing for GPT-2-style),
  the prompt's and the response's tokens, each encoded on its own without special tokens, then
  ``eos_token_id`` when the tokenizer has one. The response's tokens and the eos carry the loss.
- A chat is its messages rendered with the tokenizer's chat template
  (``apply_chat_template(tokenize=False)``, then encoded without special tokens, as transformers
  itself does). Assistant message i carries the loss on the tokens from the end of the chat
  rendered up to message i *with the generation prompt* to the end of the chat rendered
  through message i: its content and the end-of-turn tokens the template writes after it
  (ChatML's ``<|im_end|>`` and the newline after it, Llama 3's ``<|eot_id|>``). Each such
  rendering must be a token prefix of the whole chat's, except for the closing tokens that the
  template writes only where a chat ends (Phi-3's eos; found once by rendering probe chats with
  and without a last user message), which count only where the chat really ends. A template
  that renders a prefix otherwise (it rewrites earlier turns, or its generation prompt
  tokenizes differently once the message follows) is refused, naming the line. Every other
  token is masked: system and user messages, the role header that the generation prompt
  writes, what comes before the first assistant message. A template with no generation prompt
  puts the assistant's role header into the loss; that is logged.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ROLES",
    "Chat",
    "Encoded",
    "Example",
    "Message",
    "PromptResponse",
    "encode_examples",
    "load_tokenizer",
    "pad_id",
    "read_examples",
]

log = logging.getLogger("tessera.data")

ROLES = ("system", "user", "assistant")
"""The roles a chat message may have."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a chat."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class PromptResponse:
    """A prompt and the response the model learns to give; ``path`` and ``line`` say where it
    was read (for errors)."""

    prompt: str
    response: str
    path: str = "<memory>"
    line: int = 0

    @property
    def where(self) -> str:
        """``"<path> line <n>"``: how errors name the example."""
        return f"{self.path} line {self.line}"


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation whose assistant messages the model learns to give; ``path`` and
    ``line`` say where it was read (for errors)."""

    messages: tuple[Message, ...]
    path: str = "<memory>"
    line: int = 0

    @property
    def where(self) -> str:
        """``"<path> line <n>"``: how errors name the example."""
        return f"{self.path} line {self.line}"


Example = PromptResponse | Chat


_JSON_KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}


def _kind(value: Any) -> str:
    """What a JSON value is, in JSON's words ("a number", "an object", "null")."""
    if value is None:
        return "null"
    return _JSON_KINDS.get(type(value), "an object" if isinstance(value, dict) else type(value).__name__)


def _string(record: dict[str, Any], field: str, where: str, what: str) -> str:
    if field not in record:
        raise ValueError(f"{where}: {what} has no field {field!r}")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} of {what} is {_kind(value)}, not a string")
    return value


def _chat(record: dict[str, Any], field: str, where: str) -> tuple[Message, ...]:
    items = record[field]
    if not isinstance(items, list):
        raise ValueError(f"{where}: field {field!r} is {_kind(items)}, not a list of messages")
    if not items:
        raise ValueError(f"{where}: field {field!r} is an empty list; a chat needs an assistant message")
    messages = []
    for k, item in enumerate(items):
        what = f"message {k} of {field!r}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: {what} is {_kind(item)}, not a JSON object")
        role = _string(item, "role", where, what)
        if role not in ROLES:
            raise ValueError(f"{where}: {what} has role {role!r}, not one of {', '.join(ROLES)}")
        content = _string(item, "content", where, what)
        if role == "assistant" and not content.strip():
            raise ValueError(f"{where}: {what} is an assistant message with empty content")
        messages.append(Message(role, content))
    if not any(m.role == "assistant" for m in messages):
        raise ValueError(f"{where}: the chat in {field!r} has no assistant message, so nothing to learn")
    return tuple(messages)


def _example(
    text: str, path: str, line: int, *, prompt_field: str, response_field: str, messages_field: str
) -> Example:
    where = f"{path} line {line}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: {_kind(record)}, not a JSON object")
    pair = prompt_field in record or response_field in record
    if messages_field in record:
        if pair:
            raise ValueError(
                f"{where}: has both a chat ({messages_field!r}) and a prompt/response pair "
                f"({prompt_field!r}, {response_field!r}); use one form"
            )
        return Chat(_chat(record, messages_field, where), path, line)
    if not pair:
        raise ValueError(
            f"{where}: has neither {prompt_field!r} and {response_field!r} (a prompt/response pair) nor "
            f"{messages_field!r} (a chat); its fields are {', '.join(map(repr, list(record)[:8])) or 'none'}"
        )
    prompt = _string(record, prompt_field, where, "the line")
    response = _string(record, response_field, where, "the line")
    if not response.strip():
        raise ValueError(f"{where}: the response {response_field!r} is empty, so nothing to learn")
    return PromptResponse(prompt, response, path, line)


def read_examples(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
) -> list[Example]:
    """The examples of the ``.jsonl`` file ``path`` in file order (see the module docstring);
    ValueError with one line naming the file and line of the first mistake."""
    name = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    examples: list[Example] = []
    for line, raw in enumerate(data.split(b"\n"), 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} line {line}: not UTF-8 (byte {exc.start + 1} of the line)") from None
        if line == 1:
            text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
        if not text.strip():
            continue
        examples.append(
            _example(
                text,
                name,
                line,
                prompt_field=prompt_field,
                response_field=response_field,
                messages_field=messages_field,
            )
        )
    if not examples:
        raise ValueError(f"{name}: holds no examples (every line is blank)")
    return examples


@dataclass(frozen=True, slots=True)
class Encoded:
    """An example's token ids and, per token, whether it carries the loss (a response token)."""

    tokens: tuple[int, ...]
    loss: tuple[bool, ...]
    where: str = "<memory>"

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.loss):
            raise ValueError(f"{self.where}: {len(self.tokens)} tokens but {len(self.loss)} loss flags")


def load_tokenizer(folder: str | Path) -> Any:
    """The Hugging Face tokenizer saved in ``folder`` (a checkpoint folder; never downloaded)."""
    if not Path(folder).is_dir():
        raise ValueError(f"tokenizer folder {str(folder)!r} does not exist")
    try:
        transformers: Any = importlib.import_module("transformers")
    except ImportError:
        raise ValueError(
            "fine-tuning data needs the optional 'transformers' package: pip install 'tessera-launcher[hf]'"
        ) from None
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def pad_id(tokenizer: Any) -> int:
    """The id that pads rows: the tokenizer's pad token, else its eos, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Encoder:
    """Encodes examples with one tokenizer (see the module docstring for which tokens count)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = [] if eos is None else [int(eos)]
        plain, marked = self.encode("a"), [int(t) for t in tokenizer.encode("a", add_special_tokens=True)]
        at = next((i for i in range(len(marked)) if marked[i : i + len(plain)] == plain), 0)
        self.lead = marked[:at]
        self._closing: list[int] | None = None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def pair(self, prompt: str, response: str, where: str) -> Encoded:
        head = self.lead + self.encode(prompt)
        tail = self.encode(response) + self.eos
        return Encoded(tuple(head + tail), (False,) * len(head) + (True,) * len(tail), where)

    def render(self, messages: Sequence[Message], generation: bool, where: str) -> list[int]:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self.tok.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation
            )
        except Exception as exc:  # jinja2 raises its own types (and templates raise_exception)
            raise ValueError(
                f"{where}: the tokenizer's chat template fails on it: {_first_line(exc)}"
            ) from None
        if not isinstance(text, str):
            raise ValueError(f"{where}: the chat template rendered a {type(text).__name__}, not a string")
        return self.encode(text)

    def chat(self, messages: Sequence[Message], where: str) -> Encoded:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"{where}: a chat, but the tokenizer has no chat template to render it with")
        full = self.render(messages, False, where)
        loss = [False] * len(full)
        for i, message in enumerate(messages):
            if message.role != "assistant":
                continue
            before = self.render(messages[:i], True, where)
            through = self.render(messages[: i + 1], False, where)
            if full[: len(before)] != before:
                raise ValueError(
                    f"{where}: the chat template's tokens up to assistant message {i} (with the generation "
                    "prompt) are not a prefix of the whole chat's (the template or the tokenizer joins the "
                    "prompt and the message differently), so the message's tokens cannot be found"
                )
            end = _common(through, full)
            if end < len(through) and through[end:] != self.closing():
                raise ValueError(
                    f"{where}: the chat template renders the chat through message {i} differently when "
                    "later messages follow (it rewrites earlier turns), so the tokens of assistant "
                    f"message {i} cannot be found; split the chat after message {i}"
                )
            if end <= len(before):
                raise ValueError(
                    f"{where}: the chat template's tokens of assistant message {i} cannot be found "
                    "(none follow the generation prompt)"
                )
            loss[len(before) : end] = [True] * (end - len(before))
        return Encoded(tuple(full), tuple(loss), where)

    def closing(self) -> list[int]:
        """The tokens the chat template writes only where a chat ends (Phi-3's eos; mostly
        none), as a probe chat shows (rendered once)."""
        if self._closing is None:
            found = []
            for reply in ("hello", "fox"):  # closing tokens do not depend on the message
                user, assistant = Message("user", "hi"), Message("assistant", reply)
                try:
                    ended = self.render([user, assistant], False, "probe")
                    going_on = self.render([user, assistant, user], False, "probe")
                except ValueError:
                    break  # a template that refuses the probe: no closing tokens allowed
                found.append(ended[_common(ended, going_on) :])
            self._closing = found[0] if len(found) == 2 and found[0] == found[1] else []
        return self._closing

    def generation_prompt(self) -> bool:
        """Whether the chat template writes a generation prompt (a probe conversation)."""
        probe = [Message("user", "hi")]
        try:
            return self.render(probe, True, "probe") != self.render(probe, False, "probe")
        except ValueError:
            return True  # a template that refuses the probe is judged on the examples themselves


def encode_examples(examples: Sequence[Example], tokenizer: Any) -> list[Encoded]:
    """Each example's tokens and which of them carry the loss (see the module docstring)."""
    encoder = _Encoder(tokenizer)
    chats = [e for e in examples if isinstance(e, Chat)]
    if chats and getattr(tokenizer, "chat_template", None) and not encoder.generation_prompt():
        log.warning(
            "the tokenizer's chat template writes no generation prompt, so each assistant message's role "
            "header carries the loss too (%d chats)",
            len(chats),
        )
    return [
        encoder.chat(e.messages, e.where)
        if isinstance(e, Chat)
        else encoder.pair(e.prompt, e.response, e.where)
        for e in examples
    ]
