"""EmbeddingConfig: the one typed, validated description of how texts become vectors.

Method, pooling, prompt, score, alpha and normalize are declared and checked here only; the
embedder, the evaluation adapter and runner and the CLI commands take an :class:`EmbeddingConfig`
(``MoEEmbedder.encode`` still accepts the same keywords and builds one). Its dict forms are
what is persisted, so they must not change: :meth:`EmbeddingConfig.to_dict` is the form of
``moee embed`` sidecars and shard manifests, :meth:`EmbeddingConfig.experiment_kwargs` the mteb
``experiment_kwargs`` that name result-cache folders
(``alpha_auto__method_moee_sum__pooling_last__prompt_none__score_native``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from moee.embed.methods import DEFAULT_SCORE, METHOD_REGISTRY, POOLINGS, SCORES, Method, method_spec
from moee.embed.prompts import resolve_prompt
from moee.embed.validation import check_alpha, check_choice

__all__ = ["AUTO_ALPHA", "EmbeddingConfig", "check_trace_settings", "config_label"]

#: Value of ``alpha`` that asks the evaluation for the label-free per-task choice
#: (``moee.evaluation.alpha``); a vector can only be computed once a number replaces it.
AUTO_ALPHA = "auto"


def check_trace_settings(pooling: str, prompt: str | None, score: str) -> str | None:
    """Check what one forward pass depends on (pooling, prompt, score); returns the prompt template.

    Shared by :class:`EmbeddingConfig` and the callers that trace without a method
    (``MoEEmbedder.trace``, ``TraceCache``), so all of them give the same message for a mistake.
    """
    check_choice("pooling", pooling, POOLINGS)
    template = resolve_prompt(prompt)  # a typo must not become a literal prompt
    check_choice("score", score, SCORES)
    return template


def check_alpha_or_auto(alpha: Any) -> float | str:
    """A finite ``alpha >= 0`` as a float, or :data:`AUTO_ALPHA`."""
    if isinstance(alpha, str):
        if alpha != AUTO_ALPHA:
            raise ValueError(f"alpha must be a number >= 0 or {AUTO_ALPHA!r}, got {alpha!r}")
        return alpha
    return check_alpha(alpha)


@dataclass(frozen=True)
class EmbeddingConfig:
    """How texts become vectors: ``method`` (see ``moee.embed.methods.METHOD_REGISTRY``), token
    ``pooling``, ``prompt`` (``None``, a prompt name or a ``{text}`` template), routing ``score``,
    the MoEE(sum) weight ``alpha`` (a number, or ``"auto"`` in the evaluation) and ``normalize``.

    Frozen and checked on construction, so a config that exists is a valid one.
    """

    method: str = "moee_sum"
    pooling: str = "last"
    prompt: str | None = None
    score: str = DEFAULT_SCORE
    alpha: float | str = 1.0
    normalize: bool = True

    def __post_init__(self) -> None:
        method_spec(self.method)
        check_trace_settings(self.pooling, self.prompt, self.score)
        object.__setattr__(self, "alpha", check_alpha_or_auto(self.alpha))
        object.__setattr__(self, "normalize", bool(self.normalize))

    # ---------------------------------------------------------------- derived facts
    @property
    def spec(self) -> Method:
        """The method's registry entry."""
        return METHOD_REGISTRY[self.method]

    @property
    def uses_alpha(self) -> bool:
        return self.spec.uses_alpha

    @property
    def prompt_template(self) -> str | None:
        return resolve_prompt(self.prompt)

    @property
    def prompt_label(self) -> str:
        """The prompt as result folders record it: its name, ``none`` or the template."""
        return "none" if self.prompt is None else self.prompt

    @property
    def label(self) -> str:
        """A short human label, e.g. ``MoEE sum + PromptEOL (alpha=auto)``."""
        return config_label(self.experiment_kwargs())

    def width(self, hidden_size: int, n_layers: int, n_experts: int) -> int:
        """Width of this configuration's vectors for a model of that shape."""
        return self.spec.width(hidden_size, n_layers * n_experts)

    def numeric_alpha(self) -> float:
        """``alpha`` as the number ``combine`` needs (``"auto"`` must be resolved per task first)."""
        if self.alpha == AUTO_ALPHA:
            raise ValueError("alpha='auto' is chosen per task by the evaluation; give a number to embed")
        return float(self.alpha)

    def replace(self, **changes: Any) -> EmbeddingConfig:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    # ---------------------------------------------------------------- persisted forms
    def to_dict(self) -> dict[str, Any]:
        """The sidecar / shard-manifest form (``moee embed``); key order is part of the format."""
        return {
            "method": self.method,
            "pooling": self.pooling,
            "prompt": self.prompt,
            "prompt_template": self.prompt_template,
            "score": self.score,
            "alpha": self.alpha,
            "normalize": self.normalize,
        }

    def experiment_kwargs(self) -> dict[str, Any]:
        """The mteb ``experiment_kwargs`` form, which names result-cache folders.

        ``alpha`` is recorded only for methods that use it: recording it elsewhere would split
        identical results across folders. ``normalize`` is not recorded (the evaluation always
        normalises; cosine is scale-free).
        """
        kwargs: dict[str, Any] = {
            "method": self.method,
            "pooling": self.pooling,
            "prompt": self.prompt_label,
            "score": self.score,
        }
        if self.uses_alpha:
            kwargs["alpha"] = self.alpha
        return kwargs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingConfig:
        """Read :meth:`to_dict` or :meth:`experiment_kwargs` forms back (other keys are ignored;
        ``prompt="none"`` is no prompt, a missing key takes its default)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if values.get("prompt") == "none":
            values["prompt"] = None
        if values.get("normalize") is None:
            values.pop("normalize", None)
        return cls(**values)


def config_label(settings: Mapping[str, Any]) -> str:
    """The label of an ``experiment_kwargs`` dict, also one written by another moee version
    (an unknown method is shown by its name)."""
    method = settings["method"]
    spec = METHOD_REGISTRY.get(method)
    text = spec.label if spec is not None else method
    prompt = settings.get("prompt", "none")
    if prompt != "none":
        text += " + PromptEOL" if prompt == "prompteol" else f" + prompt {prompt}"
    extras = []
    if spec is not None and spec.uses_alpha:
        extras.append(f"alpha={settings.get('alpha')}")
    if settings.get("pooling", "last") != "last":
        extras.append(f"pooling={settings['pooling']}")
    if settings.get("score", DEFAULT_SCORE) != DEFAULT_SCORE:
        extras.append(f"score={settings['score']}")
    return text + (f" ({', '.join(extras)})" if extras else "")
