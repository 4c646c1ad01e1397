"""Trainer pieces that need no processes: config files, overrides and their errors,
the byte tokenizer and corpus, the data-parallel sampler, the model, the lr schedule."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

import pytest
import torch

from flexshard.trainer.components.lr_schedule import lr_factor
from flexshard.trainer.config import (
    Config,
    ConfigError,
    TrainingConfig,
    load_config,
    parse_overrides,
)
from flexshard.trainer.config.validation import hf_format
from flexshard.trainer.data.dataset import ByteTokenizer, DPSampler, builtin_corpus
from flexshard.trainer.models.model import Transformer, count_params, init_weights
from flexshard.trainer.parallel.dims import ParallelDims

from ..helpers.trainer_cases import launch_dims

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


@pytest.mark.parametrize("name", ["debug", "moe_debug", "llama3_8b", "moe"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    assert cfg.model.vocab_size == 256
    assert (cfg.model.moe.num_experts > 0) == ("moe" in name)


def test_8b_config_has_llama3_8b_shapes():
    total, _ = count_params(load_config(CONFIGS / "llama3_8b.toml").model)
    assert 6.9e9 < total < 7.1e9  # Llama-3-8B without its 128k-token embedding and head


@pytest.mark.parametrize("name, kind", [("qwen3_debug", "qwen3"), ("qwen3_moe_debug", "qwen3_moe")])
def test_qwen3_debug_configs_are_their_hf_family(name, kind):
    m = load_config(CONFIGS / f"{name}.toml").model
    assert hf_format(m) == kind and m.qk_norm and m.head_size() == 32


def test_qwen3_configs_have_the_published_shapes():
    """Qwen3-8B: 8.19B parameters; Qwen3-30B-A3B: 30.5B, 3.3B active with the embedding."""
    total, _ = count_params(load_config(CONFIGS / "qwen3_8b.toml").model)
    assert 8.18e9 < total < 8.20e9
    moe = load_config(CONFIGS / "qwen3_moe_30b_a3b.toml").model
    total, active = count_params(moe)
    assert 30.5e9 < total < 30.6e9
    assert 3.3e9 < active + moe.vocab_size * moe.dim < 3.4e9


def test_overrides_parse_like_toml_and_win_over_the_file():
    assert parse_overrides(["--training.steps", "7", "--job.dump_folder=out/x"]) == {
        "training": {"steps": 7},
        "job": {"dump_folder": "out/x"},
    }
    cfg = load_config(
        CONFIGS / "debug.toml",
        ["--training.lr", "1e-4", "--parallelism.block", "[8, 4]", "--model.moe.num_experts", "2"],
    )
    assert cfg.training.lr == 1e-4 and cfg.parallelism.block == [8, 4]
    assert cfg.model.moe.num_experts == 2 and cfg.model.dim == 64  # the file's value stays


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--training.stepz", "3"], "unknown config key 'training.stepz'"),
        (["--trainingg.steps", "3"], "unknown config key 'trainingg'"),
        (["--training.steps", "many"], "training.steps = 'many': must be int"),
        (["--training.steps", "0"], "training.steps = 0: must be at least 1"),
        (["--training.optimizer", "sgd"], "must be one of 'adamw', 'muon'"),
        (["--parallelism.dp_backend", "ddp"], "must be one of 'flexshard', 'fsdp2'"),
        (["--model.n_kv_heads", "3"], "not a multiple of model.n_kv_heads = 3"),
        (["--model.moe.top_k", "9", "--model.moe.num_experts", "4"], "model.moe.top_k = 9"),
        (["--training.steps"], "has no value"),
        (["steps", "3"], "expected an override like --training.steps 20"),
        (["--data.source", "files"], "needs data.paths"),
        (["--data.paths", '["a.txt"]'], 'data.paths is set but data.source = "builtin"'),
        (["--data.hf_path", "ds"], 'data.hf_path is set but data.source = "builtin"'),
        (["--model.vocab_size", "100"], "the byte tokenizer needs 256"),
        (["--parallelism.buckets", '[{patterns = "x", placement = "diag"}]'], "buckets[0].place"),
        (["--parallelism.buckets", '[{patterns = "x", owner = 1}]'], "unknown keys ['owner']"),
        (["--parallelism.buckets", "[{placement = 'owned'}]"], "buckets[0].patterns: a list"),
    ],
)
def test_bad_config_raises_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(CONFIGS / "debug.toml", overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallelism.tp", "3"], "parallelism.tp = 3 must divide model.n_heads"),
        (["--parallelism.ep", "2"], "parallelism.ep = 2"),
        (["--parallelism.dp_backend", "fsdp2", "--parallelism.placement", "owned"], "apply to"),
    ],
)
def test_bad_layout_raises_before_any_rank_naming_the_key(overrides, message):
    cfg = load_config(CONFIGS / "debug.toml", overrides)
    with pytest.raises(ConfigError, match=message):
        launch_dims(cfg)


def test_bad_file_and_world_size_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[training]\nsteps = \n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(broken)
    section = tmp_path / "section.toml"
    section.write_text("model = 3\n")
    with pytest.raises(ConfigError, match="'model' is a section"):
        load_config(section)
    par = load_config(None, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"])
    assert ParallelDims.from_config(par, 4).dp_size == 4
    with pytest.raises(ConfigError, match="multiply to 4 .* world size is 3"):
        ParallelDims.from_config(par, 3)
    auto = load_config(None, ["--parallelism.dp_replicate", "2"])
    assert ParallelDims.from_config(auto, 6).dp_shard == 3
    with pytest.raises(ConfigError, match="not divisible by dp_replicate"):
        ParallelDims.from_config(auto, 3)


def test_tokenizer_round_trips_the_shipped_corpus():
    text = builtin_corpus()
    assert len(text) > 40_000 and "Coriolanus" in text
    tok = ByteTokenizer()
    tokens = tok.encode(text)
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    assert tok.decode(tokens) == text
    assert tok.decode(tok.encode("naïve – ok")) == "naïve – ok"  # multi-byte UTF-8


def test_sampler_is_deterministic_disjoint_and_the_union_of_one_big_batch():
    tokens = torch.arange(10_000) % 251
    dp, batch, accum, seq = 3, 2, 2, 16

    def sampler(rank: int, size: int = dp, b: int = batch, a: int = accum) -> DPSampler:
        return DPSampler(tokens, seq, b, a, rank, size, seed=5)

    for step in (0, 1, 17):
        ids = [sampler(r).sample_ids(step, m) for r in range(dp) for m in range(accum)]
        flat = [i for chunk in ids for i in chunk]
        assert len(set(flat)) == len(flat)  # no sample on two ranks or micro-batches
        windows = [sampler(0).window_of(i) for i in flat]
        assert len(set(windows)) == len(windows)  # and no window twice within a step
        # same answer from a fresh sampler (resume needs no state)
        again = sampler(1).batch(step, 1)
        assert all(torch.equal(x, y) for x, y in zip(again, sampler(1).batch(step, 1)))
        # one rank with the whole global batch sees exactly the ranks' batches, in order
        union = torch.cat([sampler(r).batch(step, m)[0] for r in range(dp) for m in range(accum)])
        whole = sampler(0, size=1, b=dp * accum * batch, a=1).batch(step)[0]
        assert torch.equal(union, whole)
    inputs, targets = sampler(0).batch(0)
    assert inputs.shape == (batch, seq) and torch.equal(inputs[:, 1:], targets[:, :-1])
    other_seed = DPSampler(tokens, seq, batch, accum, 0, dp, seed=6).batch(0)[0]
    assert not torch.equal(other_seed, inputs)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        DPSampler(torch.arange(10), 16, 1, 1, 0, 1, seed=0)


def test_model_dense_and_moe_forward_and_seeded_init():
    cfg = load_config(CONFIGS / "moe_debug.toml").model
    model = Transformer(cfg)
    init_weights(model, 1)
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers]
    assert kinds == ["FeedForward", "MoE"]  # first_dense_layers = 1
    assert model.layers[1].feed_forward.experts.w1.shape == (4, 64, 64)  # [E, R, C]
    assert model.layers[0].attention.wk.weight.shape == (32, 64)  # 2 kv heads of 16
    logits = model(torch.randint(0, 256, (2, 12)))
    assert logits.shape == (2, 12, 256) and torch.isfinite(logits).all()
    twin = Transformer(cfg)
    init_weights(twin, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    # causal: the first position's output ignores later tokens
    tokens = torch.randint(0, 256, (1, 8))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    assert torch.allclose(model(tokens)[0, 0], model(changed)[0, 0])
    total, active = count_params(cfg)
    assert total == sum(p.numel() for p in model.parameters()) and active < total


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainingConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1, decay="cosine")
    factors = [lr_factor(s, cfg) for s in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert factors[-1] == pytest.approx(0.1)
    linear = TrainingConfig(steps=10, warmup_steps=0, min_lr_ratio=0.0, decay="linear")
    assert lr_factor(9, linear) == 0.0 and lr_factor(0, linear) == 1.0


@pytest.mark.parametrize("decay", ["cosine", "linear", "none"])
def test_lr_scheduler_gives_the_closed_form_and_resumes(decay):
    from flexshard.trainer.components.lr_schedule import build_lr_scheduler

    cfg = TrainingConfig(steps=11, warmup_steps=3, min_lr_ratio=0.1, decay=decay)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=3e-3)
    scheduler = build_lr_scheduler(optimizer, cfg)
    seen = []
    for step in range(cfg.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
        if step == 4:
            saved = (scheduler.state_dict(), optimizer.state_dict())
    # the old hand-written schedule's values, bit for bit
    assert seen == [3e-3 * lr_factor(step, cfg) for step in range(cfg.steps)]
    # a fresh optimizer and scheduler restored at step 5 carry on with the same lrs
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=3e-3)
    scheduler = build_lr_scheduler(optimizer, cfg)
    optimizer.load_state_dict(saved[1])
    scheduler.load_state_dict(saved[0])
    again = []
    for _ in range(5, cfg.steps):
        again.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert again == seen[5:] and scheduler.state_dict()["lr_lambdas"] == [None]


def _record(step: int, loss: float) -> dict:
    return {
        "step": step, "loss": loss, "tokens_per_s": 1000.0 * step, "grad_norm": 0.5,
        "lr": 1e-3, "mfu": 0.01, "peak_memory_mb": 100.0 + step,
        "comm_bytes": {"layers.0": 2_000_000, "total": 3_000_000},
    }  # fmt: skip


def test_metrics_jsonl_summary_plot_and_tensorboard(tmp_path, monkeypatch):
    from flexshard.trainer.components import metrics

    writer = metrics.MetricsWriter(tmp_path, tensorboard=True, append=False)
    for step, loss in [(1, 5.0), (2, 4.0), (3, 3.5)]:
        writer.log(_record(step, loss))
    writer.close()
    resumed = metrics.MetricsWriter(tmp_path, tensorboard=False, append=True)
    resumed.log(_record(3, 3.25))  # a resumed run repeats step 3: the later record wins
    resumed.close()
    records = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 5.0), (2, 4.0), (3, 3.25)]
    table = metrics.summary_table(records, {"run": "t"})
    assert "5.0000 -> 3.2500" in table and "layers.0 2.000" in table and "103.0" in table
    note = metrics.plot_losses(records, tmp_path / "loss.png", "t")
    if importlib.util.find_spec("matplotlib"):  # the train extra
        assert note.startswith("loss curve")
        assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert note.startswith("loss plot skipped")
    try:
        import tensorboard  # noqa: F401  (optional extra)

        assert writer.tb is not None and list((tmp_path / "tb").glob("events.out.tfevents.*"))
    except ImportError:
        assert "TensorBoard skipped" in writer.note
    # without the package the writer says so and carries on
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    skipped = metrics.MetricsWriter(tmp_path / "no_tb", tensorboard=True, append=False)
    assert skipped.tb is None and "tensorboard package is not installed" in skipped.note
    skipped.close()


def test_progress_bar_is_tqdm_with_loss_and_rate():
    import io

    from flexshard.trainer.components.metrics import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(4, initial=1, stream=stream)  # resumed after step 1
    for step in range(2, 5):
        bar.update(step, 5.0 - step, 1234.0)
    bar.close()
    text = stream.getvalue()
    assert bar.bar.n == 4 and "\r" in text and text.endswith("\n")
    assert "4/4" in text and "loss 1.0000, 1,234 tok/s" in text


def test_own_text_files_and_backend_option_errors(tmp_path):
    from flexshard.trainer.data.dataset import load_tokens
    from flexshard.trainer.parallel.sharding import check_backend_options

    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "b.txt").write_text("world")
    cfg = load_config(None, ["--data.source", "files", "--data.paths", f'["{tmp_path}/*.txt"]'])
    assert ByteTokenizer().decode(load_tokens(cfg.data, ByteTokenizer())) == "hello \nworld"
    missing = load_config(None, ["--data.source", "files", "--data.paths", '["/nonexistent/*"]'])
    with pytest.raises(ConfigError, match="matches no file"):
        load_tokens(missing.data, ByteTokenizer())
    for overrides, message in [
        (["--parallelism.placement", "owned"], "apply to dp_backend"),
        (["--training.optimizer", "muon"], 'runs on dp_backend = "flexshard" only'),
    ]:
        cfg = load_config(None, ["--parallelism.dp_backend", "fsdp2", *overrides])
        with pytest.raises(ConfigError, match=message):
            check_backend_options(cfg)


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")  # optional: pip install datasets
    from flexshard.trainer.data.dataset import load_tokens

    rows = datasets.Dataset.from_dict({"text": ["to be", "or not"], "id": [1, 2]})
    datasets.DatasetDict({"train": rows}).save_to_disk(str(tmp_path / "dd"))
    rows.save_to_disk(str(tmp_path / "plain"))
    for folder in ("dd", "plain"):
        cfg = load_config(
            None, ["--data.source", "hf_disk", "--data.hf_path", str(tmp_path / folder)]
        )
        assert ByteTokenizer().decode(load_tokens(cfg.data, ByteTokenizer())) == "to be\nor not"
    for overrides, message in [
        (["--data.hf_split", "test"], "data.hf_split 'test' not in"),
        (["--data.hf_text_field", "body"], "data.hf_text_field 'body' not in"),
    ]:
        base = ["--data.source", "hf_disk", "--data.hf_path", str(tmp_path / "dd")]
        with pytest.raises(ConfigError, match=message):
            load_tokens(load_config(None, base + overrides).data, ByteTokenizer())


def test_train_help_lists_every_key_resuming_and_the_docs(capsys):
    from flexshard.trainer.launch import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # the wrapping undone

    def sections(obj, prefix: str):
        yield prefix, obj
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from sections(value, f"{prefix}.{f.name}")

    cfg = Config()
    for top in dataclasses.fields(cfg):
        for name, section in sections(getattr(cfg, top.name), top.name):
            assert f"[{name}]" in text, name
            for f in dataclasses.fields(section):
                if not dataclasses.is_dataclass(getattr(section, f.name)):
                    assert f"{f.name}={getattr(section, f.name)!r}" in text, (name, f.name)
    assert "Running the same command again" in text and "checkpoint.resume" in text
    assert "docs/trainer.md" in text


def test_generate_help_shows_the_defaults(capsys):
    from flexshard.trainer.generate_cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("tokens to add (default: 100)", "0: greedy (default: 0.0)", "(default: 0)"):
        assert default in text, default


# ------------------------------------------------------- docs/trainer.md's key tables
ROW = re.compile(r"^\| `\[([\w.]+)\]` \| (.*) \|$", re.M)
# a key as the tables write it: `name`, or `name = "a" \| "b"` (its values) / `name = [R, C]`
KEY = re.compile(r"^([a-z_][a-z0-9_]*)(?: = (.*))?$")


def schema_keys() -> dict[str, tuple[str, ...]]:
    """Every config key, dotted, with its allowed values (a Literal's; else ())."""
    keys: dict[str, tuple[str, ...]] = {}

    def walk(section: object, prefix: str) -> None:
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):  # type: ignore[arg-type]
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                literal = typing.get_origin(hints[f.name]) is typing.Literal
                keys[prefix + f.name] = typing.get_args(hints[f.name]) if literal else ()

    walk(Config(), "")
    return keys


def documented_keys(text: str) -> dict[str, tuple[str, ...]]:
    """The keys of a markdown page's `| `[section]` | keys |` rows, with the quoted
    values each lists (() where it lists none)."""
    keys = {}
    for section, cell in ROW.findall(text):
        for span in re.findall(r"`([^`]+)`", cell):
            m = KEY.match(span)
            if m:
                values = re.findall(r'"([^"]*)"', m.group(2) or "")
                keys[f"{section}.{m.group(1)}"] = tuple(values)
    return keys


def differences(text: str) -> list[str]:
    schema, docs = schema_keys(), documented_keys(text)
    wrong = [f"{k}: not in docs/trainer.md's tables" for k in schema if k not in docs]
    wrong += [f"{k}: documented, not a config key" for k in docs if k not in schema]
    wrong += [
        f"{k}: docs list {docs[k]}, the schema allows {values}"
        for k, values in schema.items()
        if values and k in docs and set(docs[k]) != set(values)
    ]
    return wrong


def test_trainer_docs_tables_name_every_config_key_and_value():
    """What ``--help`` sends the reader to: every key (and a choice's every value) in a
    table of docs/trainer.md, and no key that does not exist."""
    assert differences((ROOT / "docs" / "trainer.md").read_text()) == []


def test_the_key_table_check_sees_a_missing_a_stale_and_a_wrong_key():
    text = (ROOT / "docs" / "trainer.md").read_text()
    edited = (
        text.replace("`task_min_len`, ", "")
        .replace("`enable`, `freq`", "`enable`, `frequency`, `freq`")
        .replace(' \\| "rl_task"', "")
    )
    assert differences(edited) == [
        "rl.task_min_len: not in docs/trainer.md's tables",
        "validation.frequency: documented, not a config key",
        "data.source: docs list ('builtin', 'files', 'hf_disk'), "
        "the schema allows ('builtin', 'files', 'hf_disk', 'rl_task')",
    ]
