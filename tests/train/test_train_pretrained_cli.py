"""`nybble train --model --data` and `nybble generate` from the command line: the outputs, an
exact resume, the merged model, and one clear line for bad input with nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from nybble import LoraConfig
from nybble.cli import main
from nybble.train import Trainer
from tests.pretrained_fixtures import write_model

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("model") / "m"
    write_model(d)
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = []
    for i in range(30):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"say {i}"},
                    {"role": "assistant", "content": f"the number {i}"},
                ]
            }
        )
    rows.append({"prompt": "the sky is", "completion": " blue"})
    rows.append({"text": "a plain text sample to learn"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(model: Path, data: Path, out: Path, *extra: str) -> int:
    args = ["train", "--model", str(model), "--data", str(data), "--out", str(out)]
    args += ["--seq-len", "48", "--batch-size", "2", "--lora-r", "4", "--lr", "1e-2", "--json"]
    return main([*args, *extra])


def test_train_writes_a_peft_adapter_and_evaluates(
    model: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _train(model, data, out, "--steps", "6", "--eval-fraction", "0.1", "--merge") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 6 and summary["held_out_loss"] is not None
    assert summary["held_out_perplexity"] == pytest.approx(np.exp(summary["held_out_loss"]))
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses["evals"]) >= 2 and losses["evals"][-1]["step"] == 6
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model) and config["r"] == 4
    # the adapter loads onto the base; the merged model is base + adapter
    trained = Trainer.from_pretrained(model, LoraConfig.from_peft(out / "adapter"), quant="nf4")
    trained.load_adapter(out / "adapter")
    merged = Trainer.from_pretrained(out / "merged", None, frozen=True)
    ids = np.arange(40)[None] % 200
    assert merged.loss(ids[:, :-1], ids[:, 1:]) == pytest.approx(
        trained.loss(ids[:, :-1], ids[:, 1:]),
        rel=2e-2,  # bf16 weights
    )


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(
    model: Path,
    data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common = ("--steps", "6", "--eval-fraction", "0", "--save-every", "2", "--warmup", "1")
    assert _train(model, data, tmp_path / "a", *common) == 0
    straight = json.loads(capsys.readouterr().out)
    # a run stopped after its 5th step (its last checkpoint: step 4), then resumed
    calls = {"n": 0}
    original = Trainer.train_batch

    def stop_after_five(self: Trainer, *args: object) -> float:
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Trainer, "train_batch", stop_after_five)
    assert _train(model, data, tmp_path / "b", *common) == 130
    monkeypatch.setattr(Trainer, "train_batch", original)
    capsys.readouterr()
    assert _train(model, data, tmp_path / "b", "--resume", *common) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["final_loss"] == straight["final_loss"]
    a = safetensors.numpy.load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
    b = safetensors.numpy.load_file(tmp_path / "b" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:  # bit for bit (the file's bytes differ only in its metadata's order)
        np.testing.assert_array_equal(a[key], b[key])
    # nothing left to do: said, not silent
    assert _train(model, data, tmp_path / "b", "--resume", *common) == 0
    assert "nothing to train" in capsys.readouterr().err
    # another length changes the cosine schedule: refused, saying what to pass
    longer = ("--steps", "8", *common[2:])
    assert _train(model, data, tmp_path / "b", "--resume", *longer) == 1
    assert "same --steps" in capsys.readouterr().err
    # other data: refused
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "something else entirely"}) + "\n")
    assert _train(model, other, tmp_path / "b", "--resume", *common) == 1
    assert "resume with the same model, data" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{data}"], "--data needs --model"),
        (["--model", "{model}"], "--model needs --data"),
        (["--model", "{model}", "--data", "{bad}"], "bad.jsonl:2"),
        (["--model", "{model}", "--data", "{data}", "--lr", "1e308"], "--lr must be in"),
        (["--model", "{model}", "--data", "{data}", "--targets", "bogus_proj"], "bogus_proj"),
        (["--model", "{model}", "--data", "{data}", "--batch-size", "1000000000000"], "tokens per"),
        (["--model", "{tmp}/nothing", "--data", "{data}"], "not found"),
        (["--model", "{model}", "--data", "{tmp}/none.jsonl"], "not found"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    model: Path,
    data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"messages": 3}\n')
    values = {"data": str(data), "model": str(model), "bad": str(bad), "tmp": str(tmp_path)}
    out = tmp_path / "out"
    code = main(["train", *(a.format(**values) for a in args), "--out", str(out), "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_a_model_without_tokenizer_cannot_read_text_data(
    model: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((model / f).read_bytes())
    assert _train(bare, data, tmp_path / "out", "--steps", "2") == 1
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_train_without_matplotlib_writes_the_rest(
    model: Path,
    data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import nybble.cli.train as cli

    monkeypatch.setattr(cli, "_plot_module", lambda: None)
    assert _train(model, data, tmp_path / "r", "--steps", "2") == 0
    err = capsys.readouterr().err
    assert err.count("loss.png skipped") == 1 and "nybble[plot]" in err
    assert (tmp_path / "r" / "adapter" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "r" / "loss.png").exists()


def test_generate(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(model),
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "5",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] <= 5 and isinstance(result["text"], str)
    assert result["prompt_tokens"] > 2  # the chat template wrapped the prompt
    assert (
        main(
            [
                "generate",
                "--model",
                str(model),
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "5",
                "--chat",
                "no",
                "--json",
            ]
        )
        == 0
    )
    raw = json.loads(capsys.readouterr().out)
    assert raw["prompt_tokens"] < result["prompt_tokens"]
    # greedy: the same as the Python call
    t = Trainer.from_pretrained(model, None, quant="nf4", frozen=True)
    assert t.generate("the cat", 5, chat=False).ids == raw["ids"]
    assert main(["generate", "--model", str(model), "--prompt", "x", "--top-p", "0"]) == 1
    assert "--top-p" in capsys.readouterr().err
