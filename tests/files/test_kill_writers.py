"""SIGKILL at every point of every writer (docs/testing.md): LoraAdapter.save_pretrained (over
an existing adapter and into a new directory), safetensors_io.save, `nybble estimate --plot`,
Trainer.save_checkpoint, Trainer.save_model, and `nybble train`'s outputs (checkpoint, losses,
config, adapter; its loss plot is written as --plot's is). The checkpoint tools
(nybble.checkpoint) have kill tests of their own (tests/checkpoint/test_checkpoint_cli.py).

A driver process (this module run with `python -c`, see `serve`) imports nybble once and forks
a child for each run of a writer. The child counts the filesystem operations it makes under the
work directory (Python's audit events: open, mkstemp, chmod, rename, replace, remove, ...) and
SIGKILLs itself just before the N-th; a first run, not killed, counts them, then N takes every
value from 1 to that count. A few more runs are killed after a random delay by the driver (a
kill inside the Rust serializer's writes). After each kill the target must hold the old content
or the new content, whole: every file byte for byte one or the other, and an adapter directory
loads (never refused) as the old or the new adapter, value for value (its files may come from
two saves while a save's pending files are the adapter). After the next run that completes, no
temporary of a killed run may remain (writers sweep the temporaries of dead processes).

`save_pretrained` over an existing adapter has two tests of its own: every kill point, each
followed by a second killed save over what it left; and random kills of chained saves (a
hundred here, NYBBLE_ADAPTER_KILLS=550 for the long run), each loading as the adapter before
or the one being saved.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nybble import LoraAdapter, LoraConfig
from nybble.errors import FormatError

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(sys, "addaudithook"), reason="needs fork and audit hooks"
)

#: Audit events that touch the filesystem (the first path argument says where).
FS_EVENTS = frozenset(
    {
        "open",
        "os.rename",
        "os.replace",
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.link",
        "os.symlink",
        "os.utime",
        "os.scandir",
        "os.listdir",
        "shutil.rmtree",
        "shutil.move",
        "tempfile.mkstemp",
        "tempfile.mkdtemp",
    }
)
#: Kills after a random delay, per writer (on top of one before every operation).
RANDOM_KILLS = 6


# --- what the writers write (built alike in the driver and in the test) --------------------------

MODULES = {"model.layers.0.self_attn.q_proj": (8, 12), "model.layers.0.self_attn.v_proj": (4, 12)}


def base_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"{m}.weight": rng.standard_normal(s).astype(np.float32) for m, s in MODULES.items()}


def adapter_version(version: str) -> LoraAdapter:
    """Two adapters over the same base: their configs differ (alpha), so a weights file of one
    beside the config of the other records another config's digest."""
    rng = np.random.default_rng(1 if version == "new" else 2)
    alpha = 4.0 if version == "new" else 8.0
    adapter = LoraAdapter(LoraConfig(r=2, alpha=alpha, target_modules=("q_proj", "v_proj")))
    for name, w in base_weights().items():
        layer = adapter.add_layer(name.removesuffix(".weight"), w)
        layer.set_lora_b(rng.standard_normal(layer.lora_b.shape))
    return adapter


def tensors_version(version: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3 if version == "new" else 4)
    return {
        "a": rng.standard_normal((64, 48)).astype(np.float32),
        "b": np.arange(100 if version == "new" else 7, dtype=np.int32),
    }


def _trainers(lora: bool) -> dict[str, Any]:
    """The tiny model's trainer before ("old") and after ("new") one step: LoRA, or full
    fine-tuning (whose saved model changes with the step)."""
    from nybble.train import Trainer, TransformerConfig, corpus_batch

    config = LoraConfig(r=2, alpha=4, target_modules=("q_proj", "v_proj")) if lora else None
    out = {}
    for version, steps in (("old", 0), ("new", 1)):
        trainer = Trainer(TransformerConfig.tiny(), config, lr=0.01)
        for i in range(steps):
            trainer.train_batch(*corpus_batch(i, 1, 8))
        out[version] = trainer
    return out


def writers(name: str, workdir: Path) -> dict[str, Callable[[], None]]:
    """The writer `name` as it writes each version ("old", "new") into `workdir`."""
    if name in ("adapter", "adapter-new-directory"):
        adapters = {v: adapter_version(v) for v in ("old", "new")}
        return {
            v: (lambda a=a: a.save_pretrained(workdir / "adapter")) for v, a in adapters.items()
        }
    if name == "safetensors":
        from nybble import safetensors_io

        path = workdir / "tensors.safetensors"
        return {
            v: (lambda v=v: safetensors_io.save(tensors_version(v), path, {"format": "pt"}))
            for v in ("old", "new")
        }
    if name == "estimate-plot":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        from nybble.cli import main

        def plot(batch: str) -> None:
            out = str(workdir / "out.png")
            assert main(["estimate", "tiny", "--batch", batch, "--plot", out]) == 0

        return {"old": lambda: plot("1"), "new": lambda: plot("2")}
    if name == "checkpoint":
        path = workdir / "checkpoint.safetensors"
        return {
            v: (lambda t=t, v=v: t.save_checkpoint(path, {"run": v}))
            for v, t in _trainers(lora=True).items()
        }
    if name == "model":
        return {
            v: (lambda t=t: t.save_model(workdir / "model"))
            for v, t in _trainers(lora=False).items()
        }
    if name == "train":
        from nybble.cli import main

        def train(steps: str, *more: str) -> None:
            args = [
                "--batch-size",
                "1",
                "--seq-len",
                "8",
                "--no-plot",
                "--out",
                str(workdir / "run"),
            ]
            assert main(["train", "--steps", steps, *args, *more]) == 0

        # A run of one step, then the same run resumed to two: every output rewritten.
        return {"old": lambda: train("1"), "new": lambda: train("2", "--resume")}
    raise KeyError(name)


# --- the driver ---------------------------------------------------------------------------------


def _under(arg: Any, root: str) -> bool:
    if not isinstance(arg, (str, bytes, os.PathLike)):
        return False
    try:
        return os.path.abspath(os.fsdecode(arg)).startswith(root)
    except (TypeError, ValueError):
        return False


def _arm(workdir: Path, kill_at: int) -> Callable[[], int]:
    """Counts this process's filesystem operations under `workdir`; SIGKILL just before the
    `kill_at`-th (0: never). Returns the count so far."""
    root = os.path.abspath(workdir) + os.sep
    count = 0

    def hook(event: str, args: tuple[Any, ...]) -> None:
        nonlocal count
        if event in FS_EVENTS and any(_under(a, root) for a in args):
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    return lambda: count


def serve(name: str, workdir: str) -> None:
    """The driver: one JSON request per stdin line ({"version", "kill_at", "kill_after"}), one
    JSON reply per stdout line ({"killed", "events", "error"}), each request run in a forked
    child."""
    directory = Path(workdir)
    write = writers(name, directory)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: run the writer, report how many operations it made
            os.close(read_end)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # stdout is the driver's reply channel
            os.dup2(null, 2)  # progress lines; an error comes back in the reply
            count = _arm(directory, int(request.get("kill_at") or 0))
            try:
                write[request["version"]]()
                reply = {"events": count()}
            except BaseException as e:
                reply = {"error": repr(e)}
            os.write(write_end, json.dumps(reply).encode())
            os._exit(0)
        os.close(write_end)
        if request.get("kill_after") is not None:
            time.sleep(float(request["kill_after"]))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read_end, "rb") as f:
            data = f.read()
        reply = json.loads(data) if data else {}
        reply["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(json.dumps(reply), flush=True)


class Driver:
    """The driver process of one writer, as the test talks to it."""

    def __init__(self, name: str, workdir: Path) -> None:
        # One thread each: the driver forks, and a fork keeps only the forking thread.
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1")
        path = [str(Path(__file__).parent), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        code = "import sys, test_kill_writers as t; t.serve(sys.argv[1], sys.argv[2])"
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, name, str(workdir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the driver ended (exit {self.process.poll()})"
        return line

    def run(
        self, version: str, kill_at: int = 0, kill_after: float | None = None
    ) -> dict[str, Any]:
        assert self.process.stdin is not None
        request = {"version": version, "kill_at": kill_at, "kill_after": kill_after}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply: dict[str, Any] = json.loads(self._line())
        assert "error" not in reply, f"the writer failed: {reply['error']}"
        return reply

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        if self.process.stdout is not None:
            self.process.stdout.close()


@contextlib.contextmanager
def driver(name: str, workdir: Path) -> Iterator[Driver]:
    d = Driver(name, workdir)
    try:
        yield d
    finally:
        d.close()


# --- states ---------------------------------------------------------------------------------------


#: The content of a writer's files (None: absent), by path relative to the work directory.
State = dict[str, bytes | None]


@dataclass(frozen=True)
class Target:
    """What a writer writes: files relative to the work directory."""

    files: tuple[str, ...]
    #: Directories the writer makes (their entries other than `files` are temporaries).
    directories: tuple[str, ...] = ()

    def snapshot(self, workdir: Path) -> State:
        return {f: _read(workdir / f) for f in self.files}

    def restore(self, workdir: Path, state: State, sweep: bool = False) -> None:
        """Puts `state` back with plain writes (not nybble's), and with `sweep` removes every
        other entry (the temporaries of killed runs)."""
        if sweep:
            for stray in self.strays(workdir):
                path = workdir / stray
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        for f, data in state.items():
            path = workdir / f
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        for d in self.directories:
            if all(state[f] is None for f in self.files if f.startswith(d + "/")):
                shutil.rmtree(workdir / d, ignore_errors=True)

    def strays(self, workdir: Path) -> list[str]:
        """Entries of the work directory and the target's directories that are not targets."""
        known = set(self.files) | set(self.directories)
        found = []
        for d in [workdir, *(workdir / x for x in self.directories)]:
            if d.is_dir():
                found += [str(p.relative_to(workdir)) for p in d.iterdir()]
        return sorted(f for f in found if f not in known)


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


ADAPTER = Target(("adapter/adapter_config.json", "adapter/adapter_model.safetensors"), ("adapter",))
TARGETS = {
    "adapter": ADAPTER,
    "adapter-new-directory": ADAPTER,
    "safetensors": Target(("tensors.safetensors",)),
    "estimate-plot": Target(("out.png",)),
    "checkpoint": Target(("checkpoint.safetensors",)),
    "model": Target(("model/model.safetensors", "model/config.json"), ("model",)),
    "train": Target(
        (
            "run/checkpoint.safetensors",
            "run/losses.json",
            "run/config.json",
            "run/adapter/adapter_config.json",
            "run/adapter/adapter_model.safetensors",
        ),
        ("run", "run/adapter"),
    ),
}


def check_adapter(workdir: Path, versions: dict[str, str]) -> None:
    """An adapter directory that exists loads, as the old or the new adapter (whichever files
    of the two saves it holds: a pending save's files are the adapter until moved in)."""
    if set(versions.values()) - {"same"} == {"absent"}:
        return
    loaded_version(workdir)


@functools.cache
def _expected(version: str) -> tuple[float, dict[str, tuple[bytes, bytes]]]:
    adapter = adapter_version(version)
    arrays = {
        n: (layer.lora_a.tobytes(), layer.lora_b.tobytes()) for n, layer in adapter.layers.items()
    }
    return adapter.config.alpha, arrays


def loaded_version(workdir: Path) -> str:
    """Which adapter `workdir / "adapter"` loads as, "old" or "new", value for value; failing
    to load (a FormatError) or loading as neither fails the test."""
    try:
        loaded = LoraAdapter.from_pretrained(workdir / "adapter", base_weights())
    except FormatError as e:
        raise AssertionError(f"the adapter directory does not load: {e}") from None
    got = (
        loaded.config.alpha,
        {n: (layer.lora_a.tobytes(), layer.lora_b.tobytes()) for n, layer in loaded.layers.items()},
    )
    for version in ("old", "new"):
        if got == _expected(version):
            return version
    raise AssertionError("the adapter loads as neither the old nor the new one")


def comparable(path: str, data: bytes | None) -> bytes | None:
    """A file's content as compared between runs: the losses without the run's speed; a
    safetensors header with its metadata sorted (the library writes its metadata map in the
    order of a Rust HashMap, which differs from process to process)."""
    if data is None:
        return None
    if path.endswith("losses.json"):
        record = json.loads(data)
        record.pop("tokens_per_s")
        return json.dumps(record, sort_keys=True).encode()
    if path.endswith(".safetensors") and len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        with contextlib.suppress(ValueError):  # a torn header stays as it is, and differs
            header = json.loads(data[8 : 8 + n])
            return json.dumps(header, sort_keys=True).encode() + data[8 + n :]
    return data


def versions_of(state: State, old: State, new: State) -> dict[str, str]:
    """Which version each file is: "old", "new", "same" (both versions wrote these bytes) or
    "absent" (where the old version has none); a file that is neither fails."""
    out = {}
    for f, data in state.items():
        now, before, after = comparable(f, data), comparable(f, old[f]), comparable(f, new[f])
        if now == after:
            out[f] = "same" if now == before else "new"
        elif now == before:
            out[f] = "old" if data is not None else "absent"
        else:
            size = "missing" if data is None else f"{len(data)} bytes"
            raise AssertionError(f"{f} is neither the old nor the new content ({size})")
    return out


# --- the tests ------------------------------------------------------------------------------------


#: The writers; the run after a killed one sweeps the temporaries it left.
WRITERS = [
    "adapter",
    "adapter-new-directory",
    "safetensors",
    "estimate-plot",
    "checkpoint",
    "model",
    "train",
]


@pytest.mark.parametrize("name", WRITERS)
def test_a_killed_writer_leaves_the_old_or_the_new_content(name: str, tmp_path: Path) -> None:
    target = TARGETS[name]
    rng = random.Random(f"{name}")
    with driver(name, tmp_path) as d:
        if name == "adapter-new-directory":
            old = target.snapshot(tmp_path)  # nothing: the directory does not exist yet
        else:
            d.run("old")
            old = target.snapshot(tmp_path)
        started = time.perf_counter()
        events = d.run("new")["events"]
        duration = time.perf_counter() - started
        new = target.snapshot(tmp_path)
        assert events >= 2 and old != new
        runs = [{"kill_at": n} for n in range(1, events + 1)]
        runs += [{"kill_after": rng.uniform(0, duration)} for _ in range(RANDOM_KILLS)]
        kills = 0
        seen: Counter[str] = Counter()
        for run in runs:
            # Every run starts alike (a writer's sweep of earlier temporaries would shift
            # the numbering of its operations); the sweep is checked at the end.
            target.restore(tmp_path, old, sweep=True)
            reply = d.run("new", **run)
            kills += reply["killed"]
            assert reply["killed"] or "kill_after" in run, f"not killed at operation {run}"
            try:
                state = versions_of(target.snapshot(tmp_path), old, new)
            except AssertionError as e:
                raise AssertionError(f"after the run {run}: {e}") from None
            seen["+".join(sorted(set(state.values())))] += 1
            if name.startswith("adapter"):
                check_adapter(tmp_path, state)
        print(f"\n{name}: {events} operations, {kills} kills; states after them: {dict(seen)}")
        assert kills >= events
        target.restore(tmp_path, old, sweep=True)
        d.run("new", kill_at=events - 1)  # killed with its temporaries written
        assert target.strays(tmp_path), "the killed run left nothing to sweep"
        reply = d.run("new")
        assert not reply["killed"]
        assert set(versions_of(target.snapshot(tmp_path), old, new).values()) <= {"new", "same"}
        assert target.strays(tmp_path) == [], "temporaries of a killed run left after a save"


@pytest.mark.parametrize("name", WRITERS)
def test_the_next_run_sweeps_what_a_killed_one_left(name: str, tmp_path: Path) -> None:
    target = TARGETS[name]
    with driver(name, tmp_path) as d:
        events = d.run("new")["events"]
        target.restore(tmp_path, {f: None for f in target.files})
        left: set[str] = set()
        for n in range(2, events + 1):
            d.run("new", kill_at=n)
            left.update(target.strays(tmp_path))
        assert left, "the killed runs left nothing to sweep: the test proves nothing"
        d.run("new")
        assert target.strays(tmp_path) == []


# --- save_pretrained over an existing adapter: every kill loads as the old or the new one ------

#: Random kills of chained adapter saves: a hundred in the test suite (about 3 s), as many as
#: NYBBLE_ADAPTER_KILLS says otherwise (550 take about 14 s on two cores).
ADAPTER_KILLS = int(os.environ.get("NYBBLE_ADAPTER_KILLS", "100"))


def _other(version: str) -> str:
    return "old" if version == "new" else "new"


def test_every_kill_of_an_adapter_save_loads_as_the_old_or_the_new_adapter(
    tmp_path: Path,
) -> None:
    """Every kill point of a save over an existing adapter, from a clean directory; then, from
    what each kill left, a second save (of the other version) killed at a point spread over
    its own sequence (which starts by finishing the first's pending files), then a complete
    save. After each: the directory loads, as one of the two adapters it may be; never
    refused. After a complete save nothing of the killed ones is left."""
    with driver("adapter", tmp_path) as d:
        d.run("old")
        old = ADAPTER.snapshot(tmp_path)
        events = d.run("new")["events"]
        seen: Counter[str] = Counter()
        kills = 0
        for n in range(1, events + 1):
            ADAPTER.restore(tmp_path, old, sweep=True)
            kills += d.run("new", kill_at=n)["killed"]
            first = loaded_version(tmp_path)
            seen[f"first kill: {first}"] += 1
            # a second save, of the other version, over what the kill left
            m = 1 + (n * 7) % (events + 4)
            kills += d.run(_other(first), kill_at=m)["killed"]
            second = loaded_version(tmp_path)
            seen[f"second kill: {'same' if second == first else 'other'}"] += 1
            d.run("new")
            assert loaded_version(tmp_path) == "new"
            assert ADAPTER.strays(tmp_path) == [], f"after kills at {n} and {m}"
        print(f"\nadapter save: {events} operations, {kills} kills; {dict(seen)}")
        assert kills >= events and seen["first kill: old"] and seen["first kill: new"]


def test_random_kills_of_chained_adapter_saves(tmp_path: Path) -> None:
    """NYBBLE_ADAPTER_KILLS saves over an existing adapter, each killed before a random one of
    its filesystem operations (some after a random delay instead, which may land inside the
    serializer), each starting from whatever the kill before left. After each the directory
    loads as the adapter it held before or as the one being saved, value for value."""
    rng = random.Random("adapter-kills")
    with driver("adapter", tmp_path) as d:
        d.run("old")
        started = time.perf_counter()
        events = d.run("new")["events"]
        duration = time.perf_counter() - started
        current = loaded_version(tmp_path)
        outcomes: Counter[str] = Counter()
        for _ in range(ADAPTER_KILLS):
            version = rng.choice(["old", "new"])
            if rng.random() < 0.1:
                reply = d.run(version, kill_after=rng.uniform(0, duration))
            else:
                reply = d.run(version, kill_at=rng.randint(1, events + 4))
            now = loaded_version(tmp_path)
            assert now in (current, version), f"was {current}, saving {version}, loads {now}"
            outcomes["killed" if reply["killed"] else "completed"] += 1
            outcomes[f"loads the {'one saved' if now == version else 'one before'}"] += 1
            current = now
        d.run("new")
        assert loaded_version(tmp_path) == "new" and ADAPTER.strays(tmp_path) == []
        print(f"\n{ADAPTER_KILLS} runs over an existing adapter: {dict(outcomes)}")
        assert outcomes["killed"] >= 0.8 * ADAPTER_KILLS
