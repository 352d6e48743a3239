"""Resolve a run spec's `model` to a local Hugging Face model directory, before actors start.

`model` is a built-in name, a local directory, or a Hugging Face hub id (`org/name`, at
`model_revision`). A hub model is downloaded once, by the driver, into the Hugging Face cache
(`HF_HOME`, or `HF_HUB_CACHE`; on a cluster a volume every pod mounts), and every actor is given
the snapshot's local path, so no actor ever reaches the hub. `HF_HUB_OFFLINE=1` resolves from the
cache alone; `HF_TOKEN` is used for gated and private repositories.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from services.tasks.registry import BUILTIN_MODELS

# `org/name` as the hub spells repository ids (one slash; letters, digits, `-`, `_`, `.`).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# What a causal LM needs from a hub repository: configs, safetensors weights, tokenizer files
# and chat templates (not the .bin, .pt or GGUF copies many repositories also hold).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class ModelDirError(ValueError):
    """A `model` that is neither a built-in name nor a usable local model directory."""


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as a hub repository id (`org/name`)."""
    return HUB_ID.fullmatch(model) is not None and ".." not in model


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The directory of `model`: a built-in name (built on first use), a local directory, or a
    hub id (`revision`: a branch, tag or commit; default main), downloaded into the cache.

    A directory must hold `config.json` naming a causal-LM architecture, so that a wrong path
    fails here with its name rather than inside a generation or learner actor.
    """
    if model in BUILTIN_MODELS:
        # Imported here: the builder pulls in transformers, which resolving a path does not need.
        from services.tasks.tiny_model import ensure_tiny_model

        return ensure_tiny_model(progress=False, name=model)
    path = Path(model).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if is_hub_id(model):
        return check_model_dir(download_hub_model(model, revision))
    builtin = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelDirError(
        f"{model!r} is not a directory, a hub id (org/name) nor a built-in model "
        f"(built-in: {builtin})"
    )


def download_hub_model(repo_id: str, revision: str | None) -> Path:
    """The local snapshot of `repo_id` at `revision`, downloaded into the cache if it is not
    there (from the cache alone under HF_HUB_OFFLINE); ModelDirError saying what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision or 'main'}"
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        reason = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else "the hub could not be reached (or HF_HUB_OFFLINE is set)"
        )
        raise ModelDirError(
            f"hub model {at} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and "
            f"{reason}: download it there first (`hf download {repo_id}`), or unset "
            "HF_HUB_OFFLINE"
        ) from None
    except GatedRepoError:
        raise ModelDirError(
            f"hub model {repo_id} is gated: accept its terms on the hub and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelDirError(f"hub model {repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ModelDirError(
            f"hub model {repo_id} does not exist, or is private (set HF_TOKEN to read it)"
        ) from None


def check_model_dir(path: Path) -> Path:
    """`path`, resolved, if it holds a config.json naming a causal-LM architecture."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelDirError(f"{path} holds no config.json (not a Hugging Face model)") from None
    except (OSError, ValueError) as error:
        raise ModelDirError(f"cannot read {config_file}: {error}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(
        isinstance(name, str) and name.endswith("ForCausalLM") for name in architectures
    ):
        raise ModelDirError(
            f"{config_file} names no causal-LM architecture "
            f"(architectures: {architectures!r}); RL needs a *ForCausalLM model"
        )
    return path.resolve()


def check_tokenizer(model_dir: Path) -> None:
    """Fail, naming the directory, when its tokenizer cannot be loaded or has no EOS token:
    generation could then never end a response, and would only stop at max_new_tokens."""
    # Imported here, as in resolve_model: resolving a path does not need transformers.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as error:
        raise ModelDirError(f"cannot load the tokenizer of {model_dir}: {error}") from None
    if tokenizer.eos_token_id is None:
        raise ModelDirError(
            f"the tokenizer of {model_dir} has no EOS token, so no response could ever end "
            "(set eos_token in its tokenizer_config.json)"
        )


def has_chat_template(model_dir: Path) -> bool:
    """Whether the tokenizer in `model_dir` ships a chat template (in tokenizer_config.json or
    a chat_template.jinja file, where transformers looks), read without loading it."""
    if (model_dir / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
