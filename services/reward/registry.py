"""Verifier names -> check function + config class, and `build_verifier` to bind one.

The built-in verifiers are listed in `_BUILTINS` below: that is the one place that names them.
Their modules are imported on first use, not with this one: every worker process of a custom
verifier imports this module (through `register_verifier`), and should not pay for sympy.
Other modules (custom tasks, tests) add verifiers with the `register_verifier` decorator; a
process only knows the verifiers of the modules it has imported, which is why `VerifierActor`
takes the modules to import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.reward.base import CheckFn, Verifier, VerifierConfig


@dataclass(frozen=True)
class VerifierSpec:
    """A registered verifier: its check and the pydantic model of its options."""

    name: str
    check: CheckFn
    config_cls: type[VerifierConfig]


def _exact() -> VerifierSpec:
    from services.reward.exact_match import ExactConfig, check_exact

    return VerifierSpec("exact", check_exact, ExactConfig)


def _math() -> VerifierSpec:
    from services.reward.math_equiv import MathConfig, check_math

    return VerifierSpec("math", check_math, MathConfig)


_BUILTINS: dict[str, Callable[[], VerifierSpec]] = {"exact": _exact, "math": _math}
_REGISTRY: dict[str, VerifierSpec] = {}  # registered verifiers, and built-ins once loaded


def _same_function(a: CheckFn, b: CheckFn) -> bool:
    # By qualified name, not identity: a module imported twice re-registers an equal function.
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register_verifier(
    name: str, config_cls: type[VerifierConfig] = VerifierConfig
) -> Callable[[CheckFn], CheckFn]:
    """Decorator registering `check(response_text, reference, config) -> Verdict` as `name`.

    Raises ValueError when `name` is built in, or taken by a different function.
    """

    def decorator(check: CheckFn) -> CheckFn:
        if name in _BUILTINS:
            raise ValueError(f"verifier name {name!r} is built in")
        existing = _REGISTRY.get(name)
        if existing is not None and not _same_function(existing.check, check):
            raise ValueError(f"verifier name {name!r} is already registered")
        _REGISTRY[name] = VerifierSpec(name, check, config_cls)
        return check

    return decorator


def builtin_verifier_names() -> list[str]:
    """Names of the verifiers that ship with the package, sorted."""
    return sorted(_BUILTINS)


def verifier_names() -> list[str]:
    """Names of the verifiers known to this process, sorted."""
    return sorted(_BUILTINS.keys() | _REGISTRY.keys())


def get_spec(name: str) -> VerifierSpec:
    """The registered verifier `name`; ValueError listing the valid names when unknown."""
    if name not in _REGISTRY and name in _BUILTINS:
        _REGISTRY[name] = _BUILTINS[name]()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown verifier {name!r}; valid names: {', '.join(verifier_names())}"
        ) from None


def build_verifier(name: str, config: VerifierConfig | Mapping[str, Any] | None = None) -> Verifier:
    """Bind verifier `name` to its config, validated by the verifier's own config class.

    `config` may be a mapping of options, an instance of the config class, or None (defaults).
    Raises ValueError for an unknown name, pydantic.ValidationError for bad options.
    """
    spec = get_spec(name)
    if isinstance(config, spec.config_cls):
        validated = config
    elif isinstance(config, VerifierConfig):
        # A config of another verifier: revalidate its fields, so options it lacks are defaults
        # and options this verifier does not have are rejected.
        validated = spec.config_cls.model_validate(config.model_dump(exclude_unset=True))
    else:
        validated = spec.config_cls.model_validate(dict(config or {}))
    return Verifier(name=name, check=spec.check, config=validated)
