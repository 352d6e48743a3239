"""Resolve a run spec's `model` to a local Hugging Face model directory, before actors start."""

from __future__ import annotations

import json
from pathlib import Path

from kpo_core.config import BUILTIN_MODELS


class ModelDirError(ValueError):
    """A `model` that is neither a built-in name nor a usable local model directory."""


def resolve_model(model: str) -> Path:
    """The directory of `model`: a built-in name (built on first use) or a local directory.

    A directory must hold `config.json` naming a causal-LM architecture, so that a wrong path
    fails here with its name rather than inside a generation or learner actor.
    """
    if model in BUILTIN_MODELS:
        # Imported here: the builder pulls in transformers, which resolving a path does not need.
        from services.tasks.tiny_model import ensure_tiny_model

        return ensure_tiny_model(progress=False)
    path = Path(model).expanduser()
    if not path.is_dir():
        builtin = ", ".join(BUILTIN_MODELS)
        raise ModelDirError(
            f"{model!r} is not a directory nor a built-in model (built-in: {builtin})"
        )
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
