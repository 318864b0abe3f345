"""The model types moee defines, and their registration with the transformers Auto classes.

:data:`MODEL_TYPES` names every ``model_type`` moee implements: its from-scratch LM
(``moee_lm``), upcycled models (``moee_upcycled``, both shipped models) and the native
DeepSeekMoE v1 (``deepseek``, which transformers 5 lacks). Importing a module of that table
registers its config with ``AutoConfig`` and its models with ``AutoModel`` /
``AutoModelForCausalLM``; :func:`register_models` imports them all (idempotent).

``import moee`` calls :func:`register_when_transformers_loads`, so the Auto classes know every
moee type after ``import moee`` without making that import pay for torch and transformers
(seconds): when transformers' Auto classes are already imported, the models are registered at
once; otherwise an import hook registers them as soon as the import that loads the Auto classes
(``transformers.models.auto.configuration_auto``, which ``AutoConfig``, ``AutoModel...`` and
``AutoTokenizer`` all import) has finished, before any of them can be used, and then removes itself.
"""

from __future__ import annotations

import _thread  # threading and typing would add ~10 ms to ``import moee``
import importlib
import sys

__all__ = ["MODEL_TYPES", "register_models", "register_when_transformers_loads"]

#: model_type -> the module that implements and registers it.
MODEL_TYPES: dict[str, str] = {
    "moee_lm": "moee.moe.lm",
    "moee_upcycled": "moee.moe.upcycled",
    "deepseek": "moee.models.deepseek_v1",
}

# What the import hook waits for: once it is imported, an Auto class may be asked for a moee type.
_AUTO_MODULE = "transformers.models.auto.configuration_auto"
_lock = _thread.RLock()
_registered = False


def register_models() -> None:
    """Register every type of :data:`MODEL_TYPES` with ``AutoConfig`` / ``AutoModel(ForCausalLM)``
    (imports torch and transformers; idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        _remove_hook()  # the imports below are plain ones
        for module in MODEL_TYPES.values():
            importlib.import_module(module)
        _registered = True


def _register_quietly() -> None:
    """:func:`register_models` for the automatic paths: a failure warns instead of breaking the import
    that triggered it (an explicit :func:`register_models`, as every moee loader calls, raises)."""
    try:
        register_models()
    except Exception as exc:  # noqa: BLE001  (reported, and raised again by the next explicit call)
        import warnings

        warnings.warn(
            f"moee could not register its model types with transformers' Auto classes: {exc}",
            stacklevel=3,
        )


def _initializing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _ready(finished: str) -> bool:
    """Whether the Auto classes are loaded and no transformers or moee module but ``finished`` (whose
    code has just run) is half imported: registering imports both, and must not meet a module whose
    names are not all defined yet."""
    if _AUTO_MODULE not in sys.modules:
        return False
    return not any(
        _initializing(name)
        for name in list(sys.modules)
        if name != finished and (name.split(".")[0] in ("transformers", "moee"))
    )


class _RegisterAfterImport:  # a meta path finder (importlib.abc is not imported: it costs ~20 ms)
    """Finds transformers and moee modules with the finders after it and, once one of them has run and
    the Auto classes are importable (:func:`_ready`), calls :func:`register_models`."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname.split(".")[0] not in ("transformers", "moee"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None


class _NotifyingLoader:  # a loader
    """The module's own loader; after its ``exec_module``, registration when :func:`_ready`."""

    def __init__(self, loader: object) -> None:
        self._loader = loader

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        self._loader.exec_module(module)
        if not _registered and _hook is not None and _ready(module.__spec__.name):
            _register_quietly()

    def __getattr__(self, name: str) -> object:  # get_source, get_resource_reader, is_package ...
        return getattr(self._loader, name)


_hook: _RegisterAfterImport | None = None


def _remove_hook() -> None:
    global _hook
    if _hook is not None:
        try:
            sys.meta_path.remove(_hook)
        except ValueError:
            pass
        _hook = None


def register_when_transformers_loads() -> None:
    """Register every moee type now if transformers' Auto classes are loaded, else as soon as they are
    (see the module docstring). What ``import moee`` runs."""
    global _hook
    with _lock:
        if _registered or _hook is not None:
            return
        if _AUTO_MODULE in sys.modules and not _initializing(_AUTO_MODULE):
            _register_quietly()
            return
        _hook = _RegisterAfterImport()
        sys.meta_path.insert(0, _hook)
