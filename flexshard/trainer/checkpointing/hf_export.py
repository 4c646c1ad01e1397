"""The files of an exported Hugging Face folder beside its weights: ``config.json``, and
what travels from the folder the run started from (``checkpoint.initial_load_in_hf``).

Exported as the folder came: its ``config.json`` field for field but for what the run
changed (``config.hf_config.exported_config``), its ``generation_config.json`` and its
tokenizer's files (``SIDE_FILES``: never weights) copied as they are. A run with a
tokenizer file of its own (one the folder does not hold) trained on that tokenizer's
ids: its tokenizer and token ids are written instead of the folder's. Without a source
folder, the config is the run's and the run's tokenizer (a file) is written."""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path
from typing import Any

from ..config.hf_config import exported_config
from ..config.schema import Config
from ..config.tokenizer import Tokenizer

# what a Hugging Face folder holds beside config.json and the weights that a user of
# the export needs as it was: generation defaults, then the tokenizer's files (fast and
# slow tokenizers' vocabularies, sentencepiece and tiktoken models, chat templates)
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "spiece.model",
    "chat_template*",
    "additional_chat_templates",
)


def source_folder(cfg: Config) -> Path | None:
    """The Hugging Face folder the run started from, while its config.json is there."""
    c = cfg.checkpoint
    if not (c.initial_load_in_hf and c.initial_load_path):
        return None
    folder = Path(c.initial_load_path)
    return folder if (folder / "config.json").is_file() else None


def own_tokenizer(tokenizer: Tokenizer | None, source: Path | None) -> bool:
    """Whether the run encoded with a tokenizer file that ``source`` does not hold (a
    file of the same contents counts as the folder's)."""
    path = getattr(tokenizer, "path", None)
    if path is None:  # the byte tokenizer: no file, the folder's tokenizer stays its own
        return False
    if source is None:
        return True
    return not any(f.is_file() and filecmp.cmp(path, f, shallow=False) for f in source.iterdir())


def _token_ids(tokenizer: Tokenizer | None) -> dict[str, int]:
    special_ids = getattr(tokenizer, "special_ids", None)
    return special_ids() if special_ids is not None else {}


def export_config(cfg: Config, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The exported ``config.json`` (every rank computes it before any file is written,
    so a refusal stops them all)."""
    source = source_folder(cfg)
    original = json.loads((source / "config.json").read_text()) if source else None
    ids = _token_ids(tokenizer) if own_tokenizer(tokenizer, source) else None
    dtype, trained = cfg.checkpoint.export_dtype, cfg.training.seq_len
    return exported_config(cfg.model, dtype, trained, original, ids)


def write_side_files(
    folder: Path, cfg: Config, config: dict[str, Any], tokenizer: Tokenizer | None
) -> None:
    """``config.json``, then the source folder's generation config and tokenizer files
    or the run's own tokenizer, into the export ``folder`` (one rank writes them)."""
    source = source_folder(cfg)
    own = own_tokenizer(tokenizer, source)
    if source is not None:
        patterns = (GENERATION_CONFIG,) if own else (GENERATION_CONFIG, *TOKENIZER_FILES)
        for path in sorted({p for pattern in patterns for p in source.glob(pattern)}):
            if path.is_dir():
                shutil.copytree(path, folder / path.name, dirs_exist_ok=True)
            else:
                shutil.copyfile(path, folder / path.name)
        if own and (folder / GENERATION_CONFIG).is_file():
            _renumber(folder / GENERATION_CONFIG, _token_ids(tokenizer))
    save = getattr(tokenizer, "save", None)
    if own and save is not None:
        save(folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _renumber(path: Path, ids: dict[str, int]) -> None:
    """The generation config's token ids as the run's tokenizer numbers them."""
    generation = json.loads(path.read_text())
    generation.update({k: v for k, v in ids.items() if k in generation})
    path.write_text(json.dumps(generation, indent=2) + "\n")
