"""Errors before training, in one line: every input problem ``flexshard-train`` can see
before the first step stops it before any rank starts (``spawn`` is never called),
as one line ``flexshard-train: <what>: ...`` naming the file, key or path, exit
status 1, no traceback. Problems only a rank meets (a checkpoint that does not load,
a text too short) come out the same way, once, under the launcher and torchrun."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flexshard.trainer import launch
from flexshard.trainer.checkpointing import preflight
from flexshard.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.toml")
TOKENIZER = ROOT / "configs" / "tokenizer" / "tokenizer.json"
QUIET = ["--job.tensorboard", "false", "--job.plot", "false", "--job.progress", "false"]


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def spawn(*_: object) -> None:
        raise AssertionError("a rank was spawned before the error was found")

    monkeypatch.setattr(launch, "spawn", spawn)


def _fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line ``flexshard-train`` exits with (to stderr, status 1)."""
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--nproc", "2", *args])
    line = exit_info.value.code
    assert isinstance(line, str) and line.startswith("flexshard-train: "), line
    assert "\n" not in line
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return line


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of the debug model (2 ranks, 2 steps): its dump folder."""
    out = tmp_path_factory.mktemp("saved")
    launch.main(["--nproc", "2", "--config", DEBUG, "--training.steps", "2",
                 "--checkpoint.enable", "true", "--job.dump_folder", str(out), *QUIET])  # fmt: skip
    assert (out / "checkpoint" / "step-2" / ".metadata").is_file()
    return out


def test_truncated_tokenizer_names_the_file(tmp_path, capsys, no_spawn):
    broken = tmp_path / "tokenizer.json"
    broken.write_bytes(TOKENIZER.read_bytes()[:3000])
    line = _fails(capsys, "--config", DEBUG, "--model.tokenizer", str(broken))
    assert f"model.tokenizer '{broken}': not a valid tokenizer.json" in line
    assert "EOF while parsing" in line
    # with an explicit vocab_size the config does not open it; the pre-start check does
    line = _fails(capsys, "--config", DEBUG, "--model.tokenizer", str(broken),
                  "--model.vocab_size", "512")  # fmt: skip
    assert f"'{broken}': not a valid tokenizer.json" in line


def test_missing_data_paths_are_named(tmp_path, capsys, no_spawn):
    pattern = str(tmp_path / "nothing" / "*.txt")
    line = _fails(capsys, "--config", DEBUG, "--data.source", "files",
                  "--data.paths", f'["{pattern}"]')  # fmt: skip
    assert line == f"flexshard-train: config error: data.paths: '{pattern}' matches no file"
    (tmp_path / "a_folder.txt").mkdir()
    line = _fails(capsys, "--config", DEBUG, "--data.source", "files",
                  "--data.paths", f'["{tmp_path}/*.txt"]')  # fmt: skip
    assert f"data.paths: '{tmp_path / 'a_folder.txt'}'" in line and "is not a file" in line
    line = _fails(capsys, "--config", DEBUG, "--data.source", "hf_disk",
                  "--data.hf_path", str(tmp_path / "no_dataset"))  # fmt: skip
    assert f"data.hf_path '{tmp_path / 'no_dataset'}'" in line


def test_missing_or_foreign_initial_load_path(tmp_path, capsys, no_spawn):
    missing = tmp_path / "none"
    line = _fails(capsys, "--config", DEBUG, "--checkpoint.initial_load_path", str(missing))
    assert line == (
        "flexshard-train: checkpoint: checkpoint.initial_load_path "
        f"'{missing}': no such file or folder"
    )
    line = _fails(capsys, "--config", DEBUG, "--checkpoint.initial_load_path", str(tmp_path))
    assert f"'{tmp_path}': not a DCP checkpoint folder (no .metadata)" in line
    line = _fails(capsys, "--config", DEBUG, "--checkpoint.initial_load_path", str(tmp_path),
                  "--checkpoint.initial_load_in_hf", "true")  # fmt: skip
    assert f"'{tmp_path}' has no config.json" in line


def test_checkpoint_of_other_shapes_before_start(saved, tmp_path, capsys, no_spawn):
    step = saved / "checkpoint" / "step-2"
    # resuming: the latest checkpoint of the dump folder
    line = _fails(capsys, "--config", DEBUG, "--job.dump_folder", str(saved),
                  "--checkpoint.enable", "true", "--model.ffn_hidden", "192")  # fmt: skip
    assert line.startswith(f"flexshard-train: checkpoint: '{step}' does not fit [model]: ")
    assert (
        "'model.layers.0.feed_forward.w1.weight' is (176, 64), the config builds (192, 64)" in line
    )
    # starting from it: a layer the checkpoint does not have
    line = _fails(capsys, "--config", DEBUG, "--job.dump_folder", str(tmp_path),
                  "--checkpoint.initial_load_path", str(step), "--model.n_layers", "3")  # fmt: skip
    assert "no tensor 'model.layers.2.attention_norm.weight'" in line


def test_checkpoint_estimate_is_the_saved_tensor_bytes(saved):
    """The disk check's estimate against a real checkpoint: the bytes of its tensors
    (weights, AdamW's two moments) less the optimizer's step counters."""
    metadata = dcp.FileSystemReader(str(saved / "checkpoint" / "step-2")).read_metadata()
    tensors = [
        m for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size") and "step" not in k
    ]
    saved_bytes = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors)
    assert preflight.checkpoint_bytes(load_config(DEBUG)) == saved_bytes


_OPENED: list[str] | None = None  # the files opened while set (an audit hook stays for good)


def _record_open(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


def test_preflight_reads_only_the_checkpoint_metadata(saved, tmp_path):
    """The launcher's checks open nothing of the checkpoint but its .metadata, resuming
    and starting from it: the tensor bytes are read once, by the ranks."""
    global _OPENED
    step = saved / "checkpoint" / "step-2"
    resume = load_config(DEBUG, ["--job.dump_folder", str(saved), "--checkpoint.enable", "true"])
    initial = load_config(DEBUG, ["--job.dump_folder", str(tmp_path),
                                  "--checkpoint.initial_load_path", str(step)])  # fmt: skip
    sys.addaudithook(_record_open)
    for cfg in (resume, initial):
        _OPENED = []
        try:
            preflight.check_before_start(cfg, 2)
            opened = {Path(p).resolve() for p in _OPENED}
        finally:
            _OPENED = None
        assert {p for p in opened if p.is_relative_to(step.resolve())} == {
            step.resolve() / ".metadata"
        }


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_on_a_cpu_machine(capsys, no_spawn):
    line = _fails(capsys, "--config", DEBUG, "--training.device", "cuda")
    assert line.startswith('flexshard-train: device: training.device = "cuda": no CUDA device')


def test_config_that_is_a_folder_or_missing(tmp_path, capsys, no_spawn):
    line = _fails(capsys, "--config", str(tmp_path))
    assert (
        line
        == f"flexshard-train: config error: --config '{tmp_path}' is a folder; give a .toml file"
    )
    line = _fails(capsys, "--config", str(tmp_path / "none.toml"))
    assert f"config file '{tmp_path / 'none.toml'}' not found" in line


def test_dump_folder_that_cannot_be_written(tmp_path, capsys, no_spawn):
    (tmp_path / "a_file").write_text("")
    dump = tmp_path / "a_file" / "out"
    line = _fails(capsys, "--config", DEBUG, "--job.dump_folder", str(dump))
    assert line.startswith(f"flexshard-train: folder: job.dump_folder '{dump}': ")
    assert f"'{tmp_path / 'a_file'}' is a file" in line
    if sys.platform == "linux":  # no file can be made in /proc, not even by root
        line = _fails(capsys, "--config", DEBUG, "--job.dump_folder", "/proc/flexshard")
        assert "job.dump_folder '/proc/flexshard': cannot write in '/proc'" in line


def test_no_room_for_one_checkpoint(tmp_path, capsys, no_spawn, monkeypatch):
    need = preflight.checkpoint_bytes(load_config(DEBUG))
    real = preflight.shutil.disk_usage

    def nearly_full(path: str) -> tuple[int, int, int]:
        total, used, _ = real(path)
        return type(real(path))(total, used, need - 1)

    monkeypatch.setattr(preflight.shutil, "disk_usage", nearly_full)
    args = ["--config", DEBUG, "--job.dump_folder", str(tmp_path / "out")]
    line = _fails(capsys, *args, "--checkpoint.enable", "true")
    assert line.startswith(
        f"flexshard-train: disk: checkpoint.folder '{tmp_path / 'out' / 'checkpoint'}': "
    )
    assert "one checkpoint needs about 1.4 MiB" in line
    # without checkpoints nothing needs the room: the run goes on to spawn
    with pytest.raises(AssertionError, match="a rank was spawned"):
        launch.main(["--nproc", "2", *args])


def _cli(*args: str, torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(torchrun), "-m", "flexshard.trainer", *args]  # fmt: skip
    else:  # the console script's own code path
        command = [sys.executable, "-m", "flexshard.trainer.launch", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_console_script_prints_exactly_one_line(tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_bytes(TOKENIZER.read_bytes()[:3000])
    done = _cli("--nproc", "2", "--config", DEBUG, "--model.tokenizer", str(broken))
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"flexshard-train: config error: model.tokenizer '{broken}': not a valid "
        "tokenizer.json (EOF while parsing an object at line 183 column 13)"
    ]


def test_a_rank_error_is_one_line_from_the_launcher(tmp_path):
    """Only a rank finds that the text is shorter than one sequence (it tokenizes)."""
    text = tmp_path / "tiny.txt"
    text.write_text("tiny text")
    args = ["--config", DEBUG, "--data.source", "files", "--data.paths", f'["{text}"]',
            "--job.dump_folder", str(tmp_path / "out"), *QUIET]  # fmt: skip
    done = _cli("--nproc", "2", *args)
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "flexshard-train: config error: the text has 9 tokens, fewer than one sequence of "
        "training.seq_len + 1 = 65"
    ]


def test_a_checkpoint_that_fails_inside_the_ranks_is_one_line(saved, capsys, monkeypatch):
    """The pre-start check turned off: the ranks' own load fails, the launcher prints
    the loader's message once."""
    from flexshard.trainer.checkpointing import preflight

    # where the launcher imports it from when a job starts
    monkeypatch.setattr(preflight, "check_before_start", lambda cfg, local: None)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--nproc", "2", "--config", DEBUG, "--job.dump_folder", str(saved),
                     "--checkpoint.enable", "true", "--model.ffn_hidden", "192"])  # fmt: skip
    line = exit_info.value.code
    step = saved / "checkpoint" / "step-2"
    assert isinstance(line, str) and "\n" not in line
    assert line.startswith(f"flexshard-train: checkpoint: cannot load checkpoint '{step}': ")
    assert "'model.layers.0.feed_forward.w1.weight' has shape (176, 64)" in line


def test_torchrun_prints_one_line_per_error(tmp_path):
    """Before the process group (a missing data file): local rank 0 says it; inside the
    ranks (a text too short): rank 0. The workers print no traceback; torchrun's own
    summary of the failed workers names the first failure's line, whichever rank it is."""
    text = tmp_path / "tiny.txt"
    text.write_text("tiny text")
    for paths, message in [
        (f'["{tmp_path}/none.txt"]', f"data.paths: '{tmp_path}/none.txt' matches no file"),
        (f'["{text}"]', "the text has 9 tokens, fewer than one sequence"),
    ]:
        done = _cli("--config", DEBUG, "--data.source", "files", "--data.paths", paths,
                    "--job.dump_folder", str(tmp_path / "out"), *QUIET, torchrun=2)  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode != 0
        # rank 0's line, unless torchrun stopped it first; torchrun's summary of the first
        # failure names it either way
        printed = [line for line in output.splitlines() if line.startswith("flexshard-train:")]
        assert len(printed) <= 1 and all(message in line for line in printed), output[-3000:]
        summary = [line for line in output.splitlines() if "traceback : flexshard-train:" in line]
        assert summary and all(message in line for line in summary), output[-3000:]
        assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output


# ------------------------------------------------------- damaged files, before any rank
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder of the debug model (config.json, one safetensors file)."""
    from safetensors.torch import save_file

    from flexshard.trainer.config.hf_config import hf_config
    from flexshard.trainer.models.hf_adapter import hf_keys
    from flexshard.trainer.models.model import Transformer

    folder = tmp_path_factory.mktemp("hf")
    cfg = load_config(DEBUG)
    (folder / "config.json").write_text(
        json.dumps(hf_config(cfg.model, "float32", cfg.training.seq_len))
    )
    state = Transformer(cfg.model).state_dict()
    keys = hf_keys(list(state), cfg.model)
    save_file({keys[k].name: v.contiguous() for k, v in state.items()}, folder / HF_FILE)
    return folder


HF_FILE = "model-00001-of-00001.safetensors"


def _damaged(hf_folder: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Copies of the folder whose safetensors file is cut short or not one: the folder
    and the message's end."""
    whole = (hf_folder / HF_FILE).read_bytes()
    cases = {
        "truncated": (
            whole[: len(whole) // 2],
            f"truncated: header says {len(whole)} bytes, file has {len(whole) // 2}",
        ),  # fmt: skip
        "header cut": (whole[:100], "truncated or not a safetensors file: its header alone"),
        "text": (b"<html>404 Not Found</html>\n", "not a safetensors file"),
        "lfs pointer": (b"version https://git-lfs.github.com/spec/v1\n", "a Git LFS pointer"),
    }
    out = {}
    for name, (data, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(hf_folder, folder)
        (folder / HF_FILE).write_bytes(data)
        out[name] = (folder, message)
    return out


def test_damaged_hf_file_is_one_line_before_start(hf_folder, tmp_path, capsys, no_spawn):
    for folder, message in _damaged(hf_folder, tmp_path).values():
        line = _fails(capsys, "--config", DEBUG, "--checkpoint.initial_load_in_hf", "true",
                      "--checkpoint.initial_load_path", str(folder))  # fmt: skip
        assert line.startswith(f"flexshard-train: checkpoint: '{folder / HF_FILE}': "), line
        assert message in line, line
    # the whole folder passes on to the ranks
    with pytest.raises(AssertionError, match="a rank was spawned"):
        launch.main(["--nproc", "2", "--config", DEBUG, "--checkpoint.initial_load_in_hf", "true",
                     "--checkpoint.initial_load_path", str(hf_folder)])  # fmt: skip


def test_truncated_dcp_metadata_names_the_reason(saved, tmp_path, capsys, no_spawn):
    step = tmp_path / "step-2"
    shutil.copytree(saved / "checkpoint" / "step-2", step)
    metadata = step / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:-50])
    line = _fails(capsys, "--config", DEBUG, "--checkpoint.initial_load_path", str(step))
    assert line == (
        f"flexshard-train: checkpoint: '{metadata}' is not a readable DCP .metadata file "
        "(truncated: it ends before its pickle does)"
    )


def _generate_fails(monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """The one line ``flexshard-generate --nproc 2`` exits with, no rank spawned."""
    from flexshard.trainer import generate_cli, launch

    def spawn(*_: object, **__: object) -> None:
        raise AssertionError("a rank was spawned before the error was found")

    monkeypatch.setattr(launch, "spawn_local", spawn)
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.main(["--nproc", "2", "--max-new-tokens", "1", *args])
    line = exit_info.value.code
    assert isinstance(line, str) and "\n" not in line, line
    return line


def test_generate_names_a_damaged_or_missing_checkpoint(hf_folder, saved, tmp_path, monkeypatch):
    for folder, message in _damaged(hf_folder, tmp_path).values():
        line = _generate_fails(monkeypatch, "--checkpoint", str(folder))
        assert line.startswith(f"flexshard-generate: '{folder / HF_FILE}': "), line
        assert message in line, line
    missing = tmp_path / "no_such_run"
    line = _generate_fails(monkeypatch, "--checkpoint", str(missing))
    assert line == f"flexshard-generate: --checkpoint '{missing}': no such folder"
    step = tmp_path / "step-2"
    shutil.copytree(saved / "checkpoint" / "step-2", step)
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:-50])
    line = _generate_fails(monkeypatch, "--checkpoint", str(step), "--config", DEBUG)
    assert line == (
        f"flexshard-generate: '{step / '.metadata'}' is not a readable DCP .metadata file "
        "(truncated: it ends before its pickle does)"
    )


def test_console_scripts_print_one_line_for_a_truncated_hf_file(hf_folder, tmp_path):
    folder = _damaged(hf_folder, tmp_path)["truncated"][0]
    train = _cli("--nproc", "2", "--config", DEBUG, "--checkpoint.initial_load_in_hf", "true",
                 "--checkpoint.initial_load_path", str(folder))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "flexshard.trainer.generate_cli", "--checkpoint", str(folder),
               "--nproc", "2"]  # fmt: skip
    generate = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    size = (hf_folder / HF_FILE).stat().st_size
    what = f"'{folder / HF_FILE}': truncated: header says {size} bytes, file has {size // 2}"
    for done, prog in ((train, "flexshard-train: checkpoint"), (generate, "flexshard-generate")):
        assert done.returncode == 1
        assert done.stderr.splitlines() == [f"{prog}: {what}"]
