"""Tier 0: fine-tuning data (``data.finetune_examples``, ``data.finetune``): jsonl examples read
and refused line by line, tokenized with the loss on the responses only (a tiny byte-level BPE
tokenizer trained here, wrapped in ``transformers``, with a small chat template; no download),
laid out in padded or packed rows, and batched in a seeded order.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tessera.launcher.data import FinetuneData, finetune_data, load_tokenizer, read_examples
from tessera.launcher.data.finetune import build_rows
from tessera.launcher.data.finetune_examples import Chat, Encoded, Message, PromptResponse, encode_examples
from tessera.launcher.testing import CHAT_TEMPLATE, tiny_tokenizer
from tessera.launcher.train.objective import IGNORE_INDEX

TEMPLATE = CHAT_TEMPLATE
TEXT = st.text(alphabet="abcdefgh xyzé.,?!\n0123", max_size=30)
RESPONSE = TEXT.filter(str.strip)


@functools.cache
def tokenizer(bos: bool = False, template: str = TEMPLATE) -> Any:
    """`tiny_tokenizer`, made once per setting."""
    pytest.importorskip("tokenizers", reason="the tokenizers package is absent")
    pytest.importorskip("transformers", reason="the optional transformers package is absent")
    return tiny_tokenizer(bos=bos, template=template)


def _write(path: Path, lines: Sequence[str | dict[str, Any]]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _runs(ids: torch.Tensor, targets: torch.Tensor) -> list[list[int]]:
    """The counted targets of a row, in maximal runs of consecutive positions."""
    runs: list[list[int]] = []
    last = -2
    for j in torch.nonzero(targets != IGNORE_INDEX).flatten().tolist():
        if j != last + 1:
            runs.append([])
        runs[-1].append(int(targets[j]))
        last = j
    return runs


def _aligned(data: FinetuneData) -> None:
    """Every counted target is the next input of its example (the last one of an example is
    its final token, which is never an input)."""
    for row, start, length in data.spans.tolist():
        ids, targets = data.ids[row, start : start + length], data.targets[row, start : start + length]
        counted = targets[:-1] != IGNORE_INDEX
        assert torch.equal(targets[:-1][counted], ids[1:][counted])


def _chat(draw: st.DrawFn) -> list[Message]:
    messages = [Message("system", draw(TEXT))] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages += [Message("user", draw(TEXT)), Message("assistant", draw(RESPONSE))]
    if draw(st.booleans()):
        messages.append(Message("user", draw(TEXT)))
    return messages


# ---------------------------------------------------------------- which tokens carry the loss


@settings(max_examples=60, deadline=None)
@given(prompt=TEXT, response=RESPONSE, bos=st.booleans())
def test_a_pair_counts_its_response_and_eos_only(prompt: str, response: str, bos: bool) -> None:
    tok = tokenizer(bos)
    encoded = encode_examples([PromptResponse(prompt, response)], tok)
    data = build_rows(encoded, seq_len=256, pad_id=0)
    head = len(tok.encode(prompt, add_special_tokens=False)) + bos
    n = len(encoded[0].tokens) - 1
    assert data.spans.tolist() == [[0, 0, n]] and data.truncated == 0
    ids, targets = data.ids[0], data.targets[0]
    assert tok.decode(ids[:head].tolist()) == ("<bos>" if bos else "") + prompt
    assert tok.decode(encoded[0].tokens[head:]) == response + "<eos>"
    first = max(head, 1)  # the first token of an example is never a target
    assert (targets[: first - 1] == IGNORE_INDEX).all() and (targets[n:] == IGNORE_INDEX).all()
    counted = targets[targets != IGNORE_INDEX].tolist()
    assert counted == list(encoded[0].tokens[first:])  # every response token after the prompt, then eos
    if head:
        assert tok.decode(counted) == response + "<eos>"
    assert data.response_tokens == len(counted)
    _aligned(data)


@st.composite
def chats(draw: st.DrawFn) -> list[Message]:
    return _chat(draw)


@settings(max_examples=40, deadline=None)
@given(messages=chats())
def test_a_chat_counts_each_assistant_message_and_its_end_of_turn(messages: list[Message]) -> None:
    tok = tokenizer()
    encoded = encode_examples([Chat(tuple(messages))], tok)[0]
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    assert list(encoded.tokens) == list(
        tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    )
    data = build_rows([encoded], seq_len=512, pad_id=0)
    runs = _runs(data.ids[0], data.targets[0])
    assert [tok.decode(run) for run in runs] == [
        m.content + "<|end|>" for m in messages if m.role == "assistant"
    ]
    assert data.response_tokens == sum(map(len, runs))
    _aligned(data)


def test_closing_newlines_and_a_closing_eos_count_as_the_template_writes_them() -> None:
    chat = (
        Message("user", "hi"),
        Message("assistant", "hello"),
        Message("user", "ok"),
        Message("assistant", "fox"),
    )
    nl = tokenizer(
        template="{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    data = build_rows(encode_examples([Chat(chat)], nl), seq_len=64, pad_id=0)
    assert [nl.decode(r) for r in _runs(data.ids[0], data.targets[0])] == ["hello<|end|>\n", "fox<|end|>\n"]
    # Phi-3's way: an eos only after the last message of a chat; it counts there and nowhere else
    phi = tokenizer(template=TEMPLATE.replace("{% endif %}", "{% else %}<eos>{% endif %}"))
    data = build_rows(encode_examples([Chat(chat)], phi), seq_len=64, pad_id=0)
    assert [phi.decode(r) for r in _runs(data.ids[0], data.targets[0])] == ["hello<|end|>", "fox<|end|><eos>"]
    closed = (*chat, Message("user", "bye"))
    data = build_rows(encode_examples([Chat(closed)], phi), seq_len=64, pad_id=0)
    assert [phi.decode(r) for r in _runs(data.ids[0], data.targets[0])] == ["hello<|end|>", "fox<|end|>"]


def test_a_template_without_a_generation_prompt_counts_the_header_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = tokenizer(template=TEMPLATE.split("{% if")[0])
    with caplog.at_level(logging.WARNING, logger="tessera.data"):
        encoded = encode_examples([Chat((Message("user", "hi"), Message("assistant", "hello")))], tok)
    assert [r.getMessage() for r in caplog.records if "generation prompt" in r.getMessage()]
    data = build_rows(encoded, seq_len=64, pad_id=0)
    assert [tok.decode(r) for r in _runs(data.ids[0], data.targets[0])] == ["<|assistant|>hello<|end|>"]


@pytest.mark.parametrize(
    ("template", "wrong"),
    [
        (  # earlier assistant turns rendered differently once the chat goes on
            "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and not loop.last %}"
            "(earlier){% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}",
            "rewrites earlier turns",
        ),
        (  # a generation prompt ending in a space, which the message's first word absorbs
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}",
            "not a prefix of the whole chat's",
        ),
        ("{{ raise_exception('roles must alternate') }}", "chat template fails on it: roles must alternate"),
        ("", "the tokenizer has no chat template"),
    ],
)
def test_templates_whose_assistant_tokens_cannot_be_found_are_refused(
    tmp_path: Path, template: str, wrong: str
) -> None:
    path = _write(
        tmp_path / "chat.jsonl",
        [
            {"prompt": "two plus two?", "response": "four"},
            "",
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2},
        ],
    )
    with pytest.raises(ValueError) as caught:
        finetune_data(path, tokenizer(template=template), seq_len=64)
    message = str(caught.value)
    assert message.startswith(f"{path} line 3: ") and wrong in message and "\n" not in message


# ---------------------------------------------------------------- rows: truncation, padding, packing


@st.composite
def encoded_examples(draw: st.DrawFn) -> list[Encoded]:
    out = []
    for k in range(draw(st.integers(1, 8))):
        n = draw(st.integers(2, 30))
        tokens = draw(st.lists(st.integers(1, 99), min_size=n, max_size=n))
        loss = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(lambda f: any(f[1:])))
        out.append(Encoded(tuple(tokens), tuple(loss), f"mem line {k + 1}"))
    return out


def _expected_row(e: Encoded, seq_len: int) -> tuple[list[int], list[int]]:
    n = min(len(e.tokens) - 1, seq_len)
    return list(e.tokens[:n]), [
        t if f else IGNORE_INDEX for t, f in zip(e.tokens[1 : n + 1], e.loss[1 : n + 1], strict=True)
    ]


@settings(max_examples=200, deadline=None)
@given(examples=encoded_examples(), seq_len=st.integers(1, 24))
def test_rows_keep_every_example_exactly_and_packing_keeps_them_in_order(
    examples: list[Encoded], seq_len: int
) -> None:
    hopeless = [e for e in examples if not any(e.loss[1 : seq_len + 1])]
    event("refused" if hopeless else "built")
    if hopeless:  # truncation would cut off every response token: refused, naming the first such line
        with pytest.raises(ValueError, match=f"^{hopeless[0].where}: .*raise seq_len$"):
            build_rows(examples, seq_len=seq_len, pad_id=0)
        return
    plain = build_rows(examples, seq_len=seq_len, pad_id=0)
    packed = build_rows(examples, seq_len=seq_len, pad_id=0, packing=True)
    truncated = sum(len(e.tokens) - 1 > seq_len for e in examples)
    assert (plain.rows, plain.seq_len, plain.examples, plain.truncated) == (
        len(examples),
        seq_len,
        len(examples),
        truncated,
    )
    assert (packed.examples, packed.truncated, packed.response_tokens) == (
        len(examples),
        truncated,
        plain.response_tokens,
    )
    for data in (plain, packed):
        covered = torch.zeros_like(data.ids, dtype=torch.bool)
        for e, (row, start, length) in zip(examples, data.spans.tolist(), strict=True):
            ids, targets = _expected_row(e, seq_len)
            assert length == len(ids)
            assert data.ids[row, start : start + length].tolist() == ids
            assert data.targets[row, start : start + length].tolist() == targets
            covered[row, start : start + length] = True
            if len(e.tokens) - 1 > seq_len:  # a truncated example fills a row alone; its tail is nowhere
                assert (start, length) == (0, seq_len)
        assert not (covered.sum(1) == 0).any()  # no empty row
        assert (data.ids[~covered] == 0).all() and (data.targets[~covered] == IGNORE_INDEX).all()
        assert data.response_tokens == int((data.targets != IGNORE_INDEX).sum())
    spans = packed.spans.tolist()
    for (row, start, length), (next_row, next_start, next_length) in itertools.pairwise(spans):
        if next_row == row:  # in order, end to end
            assert next_start == start + length
        else:  # a new row only when the next example does not fit (so none is split)
            assert (next_row, next_start) == (row + 1, 0) and start + length + next_length > seq_len


def test_truncation_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    long = "the quick brown fox jumps over the lazy dog " * 3
    path = _write(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "q", "response": long},
            {"prompt": "q", "response": "four"},
            {"prompt": "", "response": long},
        ],
    )
    with caplog.at_level(logging.INFO, logger="tessera.data"):
        data = finetune_data(path, tokenizer(), seq_len=12, packing=True)
    said = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert len(said) == 1 and "2 of 3 examples" in said[0] and "seq_len=12" in said[0]
    assert (data.examples, data.truncated, data.seq_len) == (3, 2, 12)
    assert data.spans.tolist()[0] == [0, 0, 12] and data.spans.tolist()[2] == [2, 0, 12]


def test_an_example_whose_response_truncation_cuts_off_is_refused_by_its_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "long.jsonl",
        [
            {"prompt": "q", "response": "four"},
            {"prompt": "the quick brown fox jumps over the lazy dog", "response": "no"},
        ],
    )
    with pytest.raises(ValueError) as caught:
        finetune_data(path, tokenizer(), seq_len=4)
    message = str(caught.value)
    assert message.startswith(f"{path} line 2: its first response token is token ") and "\n" not in message
    assert finetune_data(path, tokenizer(), seq_len=64).examples == 2


def test_rows_pad_with_the_pad_token() -> None:
    tok = tokenizer()
    data = build_rows(
        encode_examples([PromptResponse("q", "four")], tok), seq_len=32, pad_id=tok.pad_token_id
    )
    length = int(data.spans[0, 2])
    assert (data.ids[0, length:] == tok.pad_token_id).all() and (
        data.targets[0, length:] == IGNORE_INDEX
    ).all()
    assert data.ids.dtype == data.targets.dtype == torch.long and data.ids.shape == (1, 32)


# ---------------------------------------------------------------- batches in a seeded order


def _data(rows: int, seq_len: int = 3) -> FinetuneData:
    examples = [
        Encoded((k + 1,) * (seq_len + 1), (False, True, *(False,) * (seq_len - 1))) for k in range(rows)
    ]
    return build_rows(examples, seq_len=seq_len, pad_id=0)


def test_batches_visit_every_row_once_an_epoch_in_an_order_fixed_by_the_seed() -> None:
    data, again = _data(12), _data(12)  # two ranks building the same data
    seen = torch.cat([data.batch(step, 4, seed=7)[0][:, 0] for step in range(3)])
    assert sorted(seen.tolist()) == list(range(1, 13))  # row k starts with token k + 1
    assert torch.equal(seen, torch.cat([again.batch(step, 4, seed=7)[0][:, 0] for step in range(3)]))
    assert torch.equal(seen - 1, data.order(7, 0))
    assert not torch.equal(data.order(7, 0), data.order(8, 0)) and not torch.equal(
        data.order(7, 0), data.order(7, 1)
    )
    for step, (ids, targets) in enumerate(data.batches(5, seed=3, steps=6, start=2), start=2):
        full_ids, full_targets = data.batch(step, 5, seed=3)
        assert torch.equal(ids, full_ids) and torch.equal(targets, full_targets)
        part = data.batch(step, 5, seed=3, rows=range(2, 4))
        assert torch.equal(part[0], full_ids[2:4]) and torch.equal(part[1], full_targets[2:4])
    epoch_one = torch.cat([data.batch(step, 4, seed=7)[0][:, 0] for step in range(3, 6)])
    assert torch.equal(epoch_one - 1, data.order(7, 1))


def test_a_batch_larger_than_the_data_wraps_into_the_next_epoch() -> None:
    data = _data(3)
    ids, _ = data.batch(0, 7, seed=1)
    expected = torch.cat([data.order(1, 0), data.order(1, 1), data.order(1, 2)[:1]]) + 1
    assert torch.equal(ids[:, 0], expected)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        data.batch(0, 0, seed=1)


# ---------------------------------------------------------------- reading, and refusing, lines


GOOD_PAIR = {"prompt": "two plus two?", "response": "four", "id": 3}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}
MISTAKES = [
    ('{"prompt": "q", "response": ', "not JSON ("),
    ("[1, 2]", "a list, not a JSON object"),
    ('"just text"', "a string, not a JSON object"),
    ('{"prompt": "q"}', "the line has no field 'response'"),
    ('{"response": "a"}', "the line has no field 'prompt'"),
    ('{"prompt": "q", "response": ""}', "the response 'response' is empty"),
    ('{"prompt": "q", "response": " \\n "}', "the response 'response' is empty"),
    ('{"prompt": 3, "response": "a"}', "field 'prompt' of the line is a number, not a string"),
    ('{"prompt": "q", "response": ["a"]}', "field 'response' of the line is a list, not a string"),
    ('{"text": "x", "label": 1}', "has neither 'prompt' and 'response'"),
    ('{"messages": "hi"}', "field 'messages' is a string, not a list of messages"),
    ('{"messages": []}', "field 'messages' is an empty list"),
    (json.dumps({"messages": [USER]}), "has no assistant message"),
    (
        json.dumps({"messages": [USER, {"role": 1, "content": "x"}]}),
        "field 'role' of message 1 of 'messages' is a number",
    ),
    (
        json.dumps({"messages": [{"role": "tool", "content": "x"}, ASSISTANT]}),
        "message 0 of 'messages' has role 'tool'",
    ),
    (
        json.dumps({"messages": [{"role": "user"}, ASSISTANT]}),
        "message 0 of 'messages' has no field 'content'",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": None}, ASSISTANT]}),
        "'content' of message 0 of 'messages' is null",
    ),
    (json.dumps({"messages": ["hi", ASSISTANT]}), "message 0 of 'messages' is a string, not a JSON object"),
    (
        json.dumps({"messages": [USER, {"role": "assistant", "content": ""}]}),
        "an assistant message with empty content",
    ),
    (
        json.dumps({**GOOD_CHAT, "prompt": "q", "response": "a"}),
        "has both a chat ('messages') and a prompt/response",
    ),
]


@pytest.mark.parametrize(("line", "wrong"), MISTAKES, ids=[w for _, w in MISTAKES])
def test_each_malformed_line_is_refused_in_one_line_naming_file_and_line(
    tmp_path: Path, line: str, wrong: str
) -> None:
    path = _write(tmp_path / "data.jsonl", [GOOD_PAIR, "", GOOD_CHAT, "   ", line, GOOD_PAIR])
    with pytest.raises(ValueError) as caught:
        read_examples(path)
    message = str(caught.value)
    assert message.startswith(f"{path} line 5: ") and wrong in message and "\n" not in message


@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(st.sampled_from([GOOD_PAIR, GOOD_CHAT, "", " \t"]), max_size=6),
    mistake=st.sampled_from(MISTAKES),
)
def test_the_line_named_is_the_line_of_the_mistake(
    before: list[str | dict[str, Any]], mistake: tuple[str, str]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "data.jsonl", [*before, mistake[0], GOOD_CHAT])
        with pytest.raises(ValueError) as caught:
            read_examples(path)
    assert str(caught.value).startswith(f"{path} line {len(before) + 1}: ")


def test_files_without_examples_or_with_bytes_that_are_not_utf8_are_refused(tmp_path: Path) -> None:
    blank = _write(tmp_path / "blank.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=f"^{blank}: holds no examples"):
        read_examples(blank)
    with pytest.raises(ValueError, match="cannot be read"):
        read_examples(tmp_path / "missing.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(
        json.dumps(GOOD_PAIR).encode() + b"\n" + '{"prompt": "caf\u00e9", "response": "x"}'.encode("latin-1")
    )
    with pytest.raises(ValueError, match=f"^{bad} line 2: not UTF-8"):
        read_examples(bad)


messages_strategy = st.lists(
    st.builds(
        lambda role, content: {"role": role, "content": content}, st.sampled_from(["system", "user"]), TEXT
    ),
    max_size=3,
).flatmap(lambda head: st.builds(lambda reply: [*head, {"role": "assistant", "content": reply}], RESPONSE))
records = st.one_of(
    st.builds(lambda p, r: {"question": p, "answer": r, "extra": 1}, TEXT, RESPONSE),
    st.builds(lambda m: {"turns": m}, messages_strategy),
)


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.one_of(records, st.just("")), min_size=1).filter(lambda x: any(x)))
def test_valid_lines_read_back_as_they_were_written_with_their_line_numbers(lines: list[Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / "data.jsonl", lines)
        examples = read_examples(
            path, prompt_field="question", response_field="answer", messages_field="turns"
        )
    expected: list[PromptResponse | Chat] = []
    for n, record in enumerate(lines, 1):
        if record and "turns" in record:
            expected.append(
                Chat(tuple(Message(m["role"], m["content"]) for m in record["turns"]), str(path), n)
            )
        elif record:
            expected.append(PromptResponse(record["question"], record["answer"], str(path), n))
    assert examples == expected


# ---------------------------------------------------------------- end to end, and the tokenizer folder


def test_a_mixed_file_end_to_end_with_a_saved_tokenizer(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    tokenizer().save_pretrained(str(folder))
    tok = load_tokenizer(folder)
    assert tok.chat_template == TEMPLATE and tok.encode("hello fox") == tokenizer().encode("hello fox")
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "two plus two?", "response": " four"},
            {"messages": [{"role": "system", "content": "be brief"}, USER, ASSISTANT]},
        ],
    )
    data = finetune_data(path, tok, seq_len=24, packing=True)
    assert (data.rows, data.examples, data.truncated) == (1, 2, 0)
    runs = _runs(data.ids[0], data.targets[0])
    assert [tok.decode(r) for r in runs] == [" four<eos>", "hello<|end|>"]
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
