"""The Hugging Face export as the folder came (``checkpointing/hf_export.py``): a tiny
Qwen3 folder (context 512, ``max_window_layers`` 28, a generation config, a BPE
tokenizer's files and a chat template) and a DeepSeek-V3 one (context 256, YaRN),
made with transformers' own classes, trained 2 steps at W = 2 and exported:

- config.json is the original field for field, but for what the run changed (the
  DeepSeek export says no MTP depth: it holds no MTP weights);
- generation_config.json and the tokenizer's files are the original's byte for byte;
- ``AutoModelForCausalLM.from_pretrained`` loads it with no missing or unexpected key,
  its logits are the trainer's model's, and ``generate`` gives the tokens of the
  trained weights in the original config; ``AutoTokenizer`` reads the chat template.

Without a source folder ``max_position_embeddings`` is the model's context (YaRN's
extended one, else the trained length); a tied folder trained untied, another export
dtype and a tokenizer of the run's own change only their fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexshard.checkpoint.hf_safetensors import load_hf_safetensors
from flexshard.testing import run_distributed
from flexshard.trainer.checkpointing.hf_export import export_config, write_side_files
from flexshard.trainer.config import ConfigError, config_from_dict
from flexshard.trainer.config.hf_config import context_length, exported_config, model_fields
from flexshard.trainer.config.tokenizer import HFTokenizer
from flexshard.trainer.models.hf_adapter import hf_keys
from flexshard.trainer.models.model import Transformer
from flexshard.trainer.train import run

from .test_deepseek_v3 import DEEPSEEK_MODEL, YARN

LOGIT_ATOL = 1e-5
QWEN3 = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "max_window_layers": 28,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
DEEPSEEK = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": YARN,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
FAMILIES = {"qwen3": ("Qwen3Config", QWEN3), "deepseek_v3": ("DeepseekV3Config", DEEPSEEK)}
# not transformers' defaults: a copy, not a regenerated file, keeps them
GENERATION = {"bos_token_id": 0, "eos_token_id": 1, "max_new_tokens": 7, "top_k": 5}
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def _transformers():
    return pytest.importorskip("transformers")


def bpe_tokenizer(folder: Path, text: str, specials: tuple[str, ...] = ("<s>", "</s>")) -> None:
    """A byte-level BPE of under 300 ids with ``specials`` first (``<s>`` = 0 and
    ``</s>`` = 1 by default), saved as transformers saves one (tokenizer.json,
    tokenizer_config.json, the chat template) plus the slow tokenizer's vocab.json and
    merges.txt."""
    transformers = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator([text], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    inner.model.save(str(folder))


def hf_folder(folder: Path, family: str, **overrides: object) -> None:
    """A random model of ``family`` (norms around 1, matrices of std 0.2: the logits
    move with every tensor) with its generation config and the BPE tokenizer."""
    transformers = _transformers()
    config_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.3) if "norm" in name else param.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION, indent=2) + "\n")
    bpe_tokenizer(folder, "MENENIUS: the quick brown fox jumps over the lazy dog. " * 4)


def train_table(folder: Path, **model: object) -> dict:
    return {
        "model": {"tokenizer": str(folder / "tokenizer.json"), **model},
        "checkpoint": {
            "initial_load_path": str(folder),
            "initial_load_in_hf": True,
            "last_save_in_hf": True,
        },
        "training": {"steps": 2, "seq_len": 16, "batch_size": 2, "lr": 1e-2},
        "job": {"dump_folder": str(folder / "run"), "progress": False, "plot": False},
    }


def _train_and_export(rank: int, world_size: int, folder: str) -> None:
    for family in FAMILIES:
        run(config_from_dict(train_table(Path(folder) / family)))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}


def test_export_is_the_folder_as_it_came(tmp_path):
    transformers = _transformers()
    for family in FAMILIES:
        hf_folder(tmp_path / family, family)
    run_distributed(_train_and_export, 2, str(tmp_path), timeout=600)
    for family in FAMILIES:
        source, exported = tmp_path / family, tmp_path / family / "run" / "hf"
        original = json.loads((source / "config.json").read_text())
        config = json.loads((exported / "config.json").read_text())
        changed = {k for k in original.keys() | config.keys() if original.get(k) != config.get(k)}
        assert changed == ({"num_nextn_predict_layers"} if family == "deepseek_v3" else set())
        assert config.get("num_nextn_predict_layers", 0) == 0
        for name in ("generation_config.json", "chat_template.jinja", *TOKENIZER_FILES):
            assert (exported / name).read_bytes() == (source / name).read_bytes(), name

        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            exported, output_loading_info=True
        )
        assert not any(info.values()), (family, info)
        model.eval()
        assert model.config.max_position_embeddings == original["max_position_embeddings"]
        assert model.generation_config.max_new_tokens == GENERATION["max_new_tokens"]
        # the trained weights in the original config: what the export must behave as
        config_class = getattr(transformers, FAMILIES[family][0])
        twin, info = transformers.AutoModelForCausalLM.from_pretrained(
            exported, config=config_class.from_pretrained(source), output_loading_info=True
        )
        assert not any(info.values()), (family, info)
        twin.eval()
        assert _tensors(exported).keys() == _tensors(source).keys()
        tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
        chat = [{"role": "user", "content": "the quick brown fox"}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False)
        assert prompt == "<s>the quick brown fox</s>"
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            greedy = {"max_new_tokens": 8, "do_sample": False}
            theirs = model.generate(ids, **greedy)
            assert torch.equal(theirs, twin.generate(ids, **greedy))
            assert theirs.shape[1] > ids.shape[1]
            logits = model(ids).logits

        # the trainer's own model of the export computes the same logits
        cfg = config_from_dict({"model": model_fields(config)}).model
        mine = Transformer(cfg).eval()
        state = mine.state_dict()
        load_hf_safetensors(exported, state, hf_keys(list(state), cfg))
        with torch.no_grad():
            gap = (mine(ids) - logits).abs().max().item()
        assert gap <= LOGIT_ATOL, (family, gap)
        start = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
        with torch.no_grad():
            assert (start(ids).logits - logits).abs().max().item() > 1e-3  # it trained


# --------------------------------------------------- the run's changes, no processes
def _qwen3_config(folder: Path, **overrides: object) -> dict:
    hf_folder(folder, "qwen3", **overrides)
    return json.loads((folder / "config.json").read_text())


def test_what_the_run_changed_and_nothing_else(tmp_path):
    original = _qwen3_config(tmp_path, tie_word_embeddings=True)
    untied = config_from_dict(train_table(tmp_path, tie_embeddings=False))
    config = export_config(untied, None)
    assert {k for k in original if original[k] != config[k]} == {"tie_word_embeddings"}
    assert config["tie_word_embeddings"] is False
    as_bf16 = exported_config(untied.model, "bfloat16", 16, original)
    assert {k for k in original if original[k] != as_bf16[k]} == {"tie_word_embeddings", "dtype"}
    assert as_bf16["dtype"] == "bfloat16" and "torch_dtype" not in as_bf16
    wider = {**original, "hidden_size": 40}
    with pytest.raises(ConfigError, match=r"dim \(32 trained, 40 there\)"):
        exported_config(untied.model, "float32", 16, wider)


def test_without_a_source_folder_the_context_is_the_models(tmp_path):
    dense = config_from_dict({"training": {"seq_len": 48}})
    config = export_config(dense, None)
    assert config["max_position_embeddings"] == 48 == context_length(dense.model, 48)
    yarn = config_from_dict({"model": DEEPSEEK_MODEL, "training": {"seq_len": 48}})
    config = export_config(yarn, None)
    assert config["max_position_embeddings"] == 4 * 16  # factor x original, not 48
    assert config["rope_parameters"] == YARN


def test_a_tokenizer_of_the_runs_own_replaces_the_folders(tmp_path):
    source, own, out = tmp_path / "hf", tmp_path / "own", tmp_path / "out"
    original = _qwen3_config(source)
    own.mkdir()
    bpe_tokenizer(own, "another corpus, other merges " * 3, ("<pad>", "<unk>", "<s>", "</s>"))
    tokenizer = HFTokenizer(own / "tokenizer.json")
    assert tokenizer.special_ids() == {"bos_token_id": 2, "eos_token_id": 3}
    table = train_table(source)
    table["model"]["tokenizer"] = str(own / "tokenizer.json")
    cfg = config_from_dict(table)
    config = export_config(cfg, tokenizer)
    assert {k for k in original if original[k] != config[k]} == {"bos_token_id", "eos_token_id"}
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 3)
    out.mkdir()
    write_side_files(out, cfg, config, tokenizer)
    assert json.loads((out / "generation_config.json").read_text()) == {
        **GENERATION,
        "bos_token_id": 2,
        "eos_token_id": 3,
    }
    assert (out / "tokenizer.json").read_bytes() != (source / "tokenizer.json").read_bytes()
    assert HFTokenizer(out / "tokenizer.json").special_ids() == tokenizer.special_ids()
    for name in ("vocab.json", "merges.txt", "chat_template.jinja"):  # the folder's, not its
        assert not (out / name).exists(), name
    assert json.loads((out / "config.json").read_text()) == config
