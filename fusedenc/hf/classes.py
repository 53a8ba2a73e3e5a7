"""The classes ``patch_hf`` gives patched modules: a fusedenc mixin over HF's own class.

A patched layer, encoder or model keeps being an instance of its HF class (``isinstance``,
its methods, transformers' class-keyed registries) by becoming an instance of a subclass
made at patch time, one per (mixin, HF class).  Such a class has no importable name, so
pickle could not find it: ``subclass`` makes classes whose instances pickle as "an instance
of ``subclass(mixin, base)``" plus their state, which rebuilds the class on load (the mixin
and the HF class are importable), so ``torch.save(model)`` / ``torch.load`` and
``copy.deepcopy`` work on patched models.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["mix_in", "subclass"]

_CLASSES: dict[tuple[type, type], type] = {}
_LOCK = threading.Lock()


def subclass(mixin: type, base: type) -> type:
    """The class ``(mixin, base)``, made once and reused, named ``mixin.name_prefix`` + the
    base's name (``save_pretrained`` writes it into a config's "architectures")."""
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        with _LOCK:
            cls = _CLASSES.get(key)
            if cls is None:
                body = {"__module__": mixin.__module__, "__reduce_ex__": _reduce_ex,
                        "_fusedenc_mixin": mixin, "_fusedenc_hf_class": base}  # fmt: skip
                cls = _CLASSES[key] = type(getattr(mixin, "name_prefix", "") + base.__name__, (mixin, base), body)
    return cls


def mix_in(module, mixin: type) -> None:
    """Make ``module`` an instance of ``subclass(mixin, type(module))``."""
    module.__class__ = subclass(mixin, type(module))
    _register_recordable(module)


def _register_recordable(module) -> None:
    """transformers 5 looks up what a model can record (``output_hidden_states``, ...) by its
    class's name, registered when the model is made: a model given a new class here (or
    loaded as one) is registered alike."""
    recordable = getattr(module, "_can_record_outputs", None)
    if recordable is None:
        return
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # transformers 4.x: outputs are returned by the forward itself
        return
    # Keyed by str(class) in every 5.x; 5.17 is a plain dict indexed with that string, later
    # versions a dict subclass whose __setitem__ takes the model: write the key itself.
    dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(module)), recordable)


def _reduce_ex(self, protocol):
    return _new, (self._fusedenc_mixin, self._fusedenc_hf_class), self.__getstate__()


def _new(mixin: type, base: type) -> Any:
    """An empty instance of ``subclass(mixin, base)`` (pickle then restores its state)."""
    module = object.__new__(subclass(mixin, base))
    _register_recordable(module)  # reads a class attribute: no state needed
    return module
