"""A sequence's state apart from the model: its KV cache and the tokens the cache holds. A ``Session`` owns one;
any number of sequences share a model (its weights, RoPE table and decode plan), and a decode step serves one
sequence by pointing the plan's attention at that sequence's cache."""

from __future__ import annotations

import weakref


class Sequence:
    """The KV cache of one sequence of ``model`` (``context`` positions, at most the model's; the model's dtype)
    and ``ids``, the tokens whose keys and values it holds. ``adopt``: take the model's own cache where no other
    sequence holds it (the first session of a model costs no memory beyond the load's)."""

    def __init__(self, model, context: int | None = None, adopt: bool = True):
        context = model.context if context is None else context
        if type(context) is not int or not 0 < context <= model.context:
            raise ValueError(f"a sequence holds 1 to {model.context} positions (the model's context; load the "
                             f"model with a larger one for more), got {context!r}")
        owner = model.cache_owner() if isinstance(model.cache_owner, weakref.ref) else None
        self.adopted = adopt and owner is None and context == model.context and model.cache_k is not None
        if self.adopted:
            self.k, self.v = model.cache_k, model.cache_v
            model.cache_owner = weakref.ref(self)
        else:
            self.k, self.v = model.new_kv(context, model.kv_dtype)
        self.context, self.kv_dtype = context, model.kv_dtype
        self.ids: list[int] = []
        self.glue_handles = None  # per layer, its keys' and values' handles for the decode glue (DecodePlan)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def current(self, model) -> bool:
        """Whether this sequence still fits ``model``: the same context and dtype, and, for the model's own cache,
        that cache (``setup_cache`` since makes a new one)."""
        return (self.context, self.kv_dtype) == (model.context, model.kv_dtype) and \
            (not self.adopted or self.k is model.cache_k)
