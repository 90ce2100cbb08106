"""Fine-tuning data: the three record kinds and what each learns, errors naming file:line,
packing that keeps samples whole and apart, the eval split, and the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nybble.errors import FormatError
from nybble.models import Tokenizer
from nybble.train.dataset import (
    PackedBatches,
    pieces,
    read_samples,
    split_eval,
)
from nybble.train.functional import IGNORE_INDEX
from tests.pretrained_fixtures import CHATML, write_tokenizer

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return Tokenizer.from_directory(d)


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _learned_text(tok: Tokenizer, ids: np.ndarray, learn: np.ndarray) -> str:
    return tok.decode(ids[learn].tolist(), skip_special_tokens=False)


def test_text_learns_every_token_and_ends_with_eos(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "a.txt"
    path.write_text("the first document\nstill the first\n\n\nthe second one\n")
    samples = read_samples(path, tok)
    assert [s.where for s in samples] == [f"{path}:1", f"{path}:5"]
    assert tok.decode(samples[0].ids.tolist()) == "the first document\nstill the first"
    assert samples[0].ids[-1] == tok.eos_id
    assert samples[0].learn[1:].all() and not samples[0].learn[0]


def test_prompt_completion_learns_the_completion_only(tmp_path: Path, tok: Tokenizer) -> None:
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "Q: the sky? A:", "completion": " blue"}])
    (s,) = read_samples(path, tok)
    assert _learned_text(tok, s.ids, s.learn) == " blue<|im_end|>"
    assert tok.decode(s.ids.tolist()) == "Q: the sky? A: blue"


def test_chat_learns_the_assistant_turns_only(tmp_path: Path, tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "bye"},
    ]
    (s,) = read_samples(_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    assert tok.decode(s.ids.tolist(), skip_special_tokens=False) == tok.render_chat(messages)
    learned = _learned_text(tok, s.ids, s.learn)
    assert learned == "hello<|im_end|>\nbye<|im_end|>\n"


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"txt": "x"}', "needs `text`"),
        ('{"text": 5}', "expected a string"),
        ('{"prompt": "a"}', "expected a string"),
        ('{"messages": "hi"}', "role, content"),
        ('{"messages": [{"role": "user"}]}', "role, content"),
        ('{"text": NaN}', "not valid JSON"),
        ('{"text": 1e999}', "beyond float64"),
    ],
)
def test_a_bad_line_is_named_by_file_and_line(
    tmp_path: Path, tok: Tokenizer, line: str, problem: str
) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "the first is fine"}\n\n' + line + "\n")
    with pytest.raises(FormatError, match=problem) as e:
        read_samples(path, tok)
    assert e.value.source == f"{path}:3"


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("d.csv", b"a,b\n", "a data file is"),
        ("d.txt", b"\xff\xfe bad", "not UTF-8"),
        ("d.txt", b"\n\n", "no sample"),
        ("d.jsonl", b'{"text": ""}\n', "no sample"),
    ],
)
def test_bad_files(tmp_path: Path, tok: Tokenizer, name: str, content: bytes, problem: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(FormatError, match=problem):
        read_samples(path, tok)
    with pytest.raises(FormatError, match="not found"):
        read_samples(tmp_path / "missing.jsonl", tok)


def test_a_template_that_is_not_turn_by_turn_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "tok"
    write_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    # renders the last message first: no prefix of the whole is a prefix of the turns
    config["chat_template"] = "{% for m in messages|reverse %}{{ m['content'] }}|{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(FormatError, match="concatenation of its turns"):
        read_samples(
            _jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), Tokenizer.from_directory(d)
        )


def test_the_chat_template_is_rendered_as_transformers_does(tok: Tokenizer) -> None:
    assert tok.chat_template == CHATML
    text = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- packing ----------------------------------------------------------------------------------


def _samples(tok: Tokenizer, tmp_path: Path, texts: list[str]) -> list:  # type: ignore[type-arg]
    return read_samples(_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts]), tok)


def test_rows_hold_whole_samples_with_their_starts(tmp_path: Path, tok: Tokenizer) -> None:
    texts = [f"sample number {i} " + "x" * (i % 7) for i in range(40)]
    samples = _samples(tok, tmp_path, texts)
    ps, truncated = pieces(samples, 24)
    assert truncated == 0 and len(ps) == 40
    packed = PackedBatches(ps, 24, 3, seed=5, pad_id=tok.pad_id)
    seen = []
    for b in range(packed.rows_per_epoch // 3):
        inputs, targets, starts = packed.batch(b)
        for r in range(3):
            # each segment: a piece whole, its starts constant, targets its inputs shifted
            for s in np.unique(starts[r]):
                span = np.flatnonzero(starts[r] == s)
                assert span[0] == s and np.all(np.diff(span) == 1)
                row_in = inputs[r, span]
                if (targets[r, span] == IGNORE_INDEX).all():
                    assert (row_in == tok.pad_id).all()  # the padding at the end
                    continue
                seen.append(tuple(row_in))
                np.testing.assert_array_equal(row_in[1:], targets[r, span][:-1])
    assert set(seen) <= {tuple(p.inputs) for p in ps}
    assert len(set(seen)) == len(seen) >= 30  # no piece twice within an epoch


def test_batches_are_a_function_of_their_index(tmp_path: Path, tok: Tokenizer) -> None:
    ps, _ = pieces(_samples(tok, tmp_path, [f"text {i}" for i in range(30)]), 16)
    a = PackedBatches(ps, 16, 2, seed=1, pad_id=0)
    b = PackedBatches(ps, 16, 2, seed=1, pad_id=0)
    late = [x.copy() for x in a.batch(25)]  # epoch 2 or later, asked for first
    for i in (0, 7, 25, 3):
        for x, y in zip(a.batch(i), b.batch(i), strict=True):
            np.testing.assert_array_equal(x, y)
    for x, y in zip(late, b.batch(25), strict=True):
        np.testing.assert_array_equal(x, y)
    other = PackedBatches(ps, 16, 2, seed=2, pad_id=0)
    assert not all(np.array_equal(x, y) for x, y in zip(a.batch(0), other.batch(0), strict=True))


def test_long_texts_are_cut_and_long_chats_truncated(tmp_path: Path, tok: Tokenizer) -> None:
    long_text = _samples(tok, tmp_path, ["word " * 40])
    ps, truncated = pieces(long_text, 16)
    assert truncated == 0 and len(ps) > 2
    assert sum(p.inputs.size for p in ps) == long_text[0].ids.size - 1
    chat = read_samples(
        _jsonl(tmp_path / "p.jsonl", [{"prompt": "a " * 3, "completion": "b " * 30}]), tok
    )
    ps, truncated = pieces(chat, 16)
    assert truncated == 1 and len(ps) == 1 and ps[0].inputs.size == 16


def test_the_eval_split_is_seeded_and_never_takes_all(tmp_path: Path, tok: Tokenizer) -> None:
    samples = _samples(tok, tmp_path, [f"s {i}" for i in range(40)])
    train, held = split_eval(samples, 0.1, seed=3)
    assert len(held) == 4 and len(train) == 36
    assert [s.where for s in held] == [s.where for s in split_eval(samples, 0.1, seed=3)[1]]
    assert split_eval(samples[:5], 0.1, 0) == (samples[:5], [])
    with pytest.raises(ValueError):
        split_eval(samples, 1.0, 0)
