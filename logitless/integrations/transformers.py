"""Hugging Face ``transformers``: a causal LM's training loss through logitless.

One call::

    from transformers import AutoModelForCausalLM
    from logitless.integrations.transformers import patch_causal_lm

    model = AutoModelForCausalLM.from_pretrained(...)
    patch_causal_lm(model)                      # backend / tuning keywords optional
    loss = model(input_ids, labels=labels).loss  # no [tokens, vocab] logits were made

When the model is called with ``labels`` (and optionally ``shift_labels``, which then replace
the shifted labels, as in transformers) in training mode, the patched
forward runs the model's own forward with ``logits_to_keep`` set to an empty slice (so the
LM head produces a ``[batch, 0, vocab]`` tensor), takes the final hidden states from the
decoder's output, and computes the loss as ``transformers``' ``ForCausalLMLoss`` does — labels
shifted by one with ``ignore_index`` padding, ``sum / num_items_in_batch`` when the Trainer
passes ``num_items_in_batch`` (gradient accumulation), ``mean`` over non-ignored tokens
otherwise — with :func:`logitless.torch.linear_cross_entropy` on the LM head's weight (and
Gemma-2/3's final logit softcap). The output's ``logits`` is ``None`` then (with
``return_dict=False``, ``None`` keeps its place in the tuple). The hidden states move to the
head's device first, as accelerate's ``lm_head`` hook moves them. Without labels, or
in eval mode (unless ``fuse_in_eval=True``), the model's forward runs untouched.

The patch is per instance (``model.forward``), keeps the forward's signature (the Trainer
reads it), survives ``copy.deepcopy`` and is undone by :func:`unpatch_causal_lm` (also under a
hook that accelerate's ``add_hook_to_module`` added afterwards; another wrapper of
``model.forward`` added after patching makes unpatching refuse rather than drop it).

Only architectures whose forward does nothing between the LM head and the loss but what is
reproduced here are accepted (:data:`SUPPORTED_MODEL_TYPES`); the others (e.g. MoE models,
whose loss adds a router term, or heads that rescale the logits) raise ``NotImplementedError``,
as do a subclass that overrides ``forward`` and a custom ``loss_function``; the LM head must be
a plain ``torch.nn.Linear`` (checked at every call: a LoRA wrapper added after patching would
otherwise lose its delta).

The fused loss reads ``lm_head.weight`` itself, bypassing the head's forward, so a weight that
is materialised only inside that forward is refused with an error saying why (at patch time
where it is already visible, else at the call): a head offloaded by accelerate (its weight
kept on the ``meta`` device), a head sharded by transformers' tensor parallelism (``tp_plan``:
a ``DTensor``; the vocab-parallel path is ``logitless.torch.linear_cross_entropy(...,
process_group=...)`` on the local shard), or a weight that is not the head's full
``(config.vocab_size, in_features)`` matrix when the loss reads it. A model sharded with FSDP2
(at its root or an outer one, e.g. a PEFT model) or wrapped by FSDP1 is accepted: the wrapper's
forward hands the head a plain, gathered weight before the loss reads it.

For the same reason, whatever changes the head's computation on the instance is refused (at
patch time and at every fused call): a ``forward`` replaced on the head (a user's wrapper,
transformers' tensor-parallel ``tp_forward``, an accelerate hook other than the one below) and
forward / backward (pre-)hooks registered on the head. The model's own forward still calls the
head, on an empty ``[batch, 0, hidden]`` slice, so such a hook would see no logits and its edits
would never reach the loss. Accepted: accelerate's device-placement hook
(``AlignDevicesHook`` without offload, alone or in a ``SequentialHook``, as ``device_map`` over
GPUs puts on ``lm_head``), whose only effect, moving the input to the head's device, the patch
reproduces; and torch's pre-hooks that only set the weight before each forward (pruning, the
legacy ``weight_norm`` / ``spectral_norm``), which run in that empty-slice call, before the loss
reads the weight. Global module hooks (``register_module_forward_hook``) are not considered:
they apply to every module and are trackers (``FlopCounterMode``, ``ModuleTracker``), which
still see the head called. A parametrized weight (``torch.nn.utils.parametrize``: weight norm,
spectral norm) is read through ``head.weight``, computed once per call as in the head's own
forward (``parametrize.cached()``: spectral norm's power iteration steps at each read).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .. import torch as lt

__all__ = ["patch_causal_lm", "unpatch_causal_lm", "is_patched", "SUPPORTED_MODEL_TYPES"]

# model_type -> name of the config attribute holding the final logit softcap (None: no cap).
# Each listed type's ``*ForCausalLM.forward`` computes ``lm_head(hidden[:, logits_to_keep])``
# (then the softcap, if named), then ``ForCausalLMLoss``: verified on the transformers source
# and by tests/test_transformers_integration.py.
SUPPORTED_MODEL_TYPES: Dict[str, Optional[str]] = {
    "llama": None,
    "mistral": None,
    "qwen2": None,
    "qwen3": None,
    "gemma": None,
    "gemma2": "final_logit_softcapping",
    "gemma3_text": "final_logit_softcapping",
    "phi3": None,
    "olmo2": None,
}

_STATE = "_logitless_state"
_SLOT = "_logitless_hidden"


def _keep_hidden(module, inputs, output):
    # registered once at patch time (registering per call breaks torch.compile's graph);
    # a function of the module only, so that copy.deepcopy gives the copy its own slot
    slot = module.__dict__.get(_SLOT)
    if slot:  # [True] while a fused call runs
        slot.append(output.last_hidden_state if hasattr(output, "last_hidden_state")
                    else output[0])


@dataclasses.dataclass
class _State:
    softcap_attr: Optional[str]
    fuse_in_eval: bool
    backend: Optional[str]
    tuning: Dict[str, Any]
    had_instance_forward: bool
    inner_forward: Any       # what model.forward was before patching (a bound method)
    signature: inspect.Signature
    hook_id: Optional[int] = None
    # the function model.forward is bound to while patched: how unpatching recognises it
    # (copy.deepcopy keeps functions as they are, so a copy's forward is recognised too)
    patched_func: Any = None


def patch_causal_lm(model, *, backend: Optional[str] = None, fuse_in_eval: bool = False,
                    **tuning):
    """Make ``model`` (a ``transformers`` causal LM) compute its loss with logitless.

    Args:
        model: a ``PreTrainedModel`` whose ``config.model_type`` is in
            :data:`SUPPORTED_MODEL_TYPES` (e.g. ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``Gemma2ForCausalLM``).
        backend: passed to :func:`logitless.torch.linear_cross_entropy` (``None``: Triton on
            CUDA, the chunked PyTorch backend elsewhere).
        fuse_in_eval: also use the fused loss when ``model.training`` is False (the output
            then has no logits either; by default evaluation keeps the model's own path, so
            that metrics can read the logits).
        **tuning: the backend's tuning keywords (e.g. ``low_memory=True``, ``chunk_size``).

    Returns:
        ``model`` itself, patched in place. Patching twice replaces the options.
    """
    if is_patched(model):
        unpatch_causal_lm(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"patch_causal_lm: model_type {model_type!r} ({type(model).__name__}) is not "
            f"supported; supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    _check_own_loss(model, model_type)
    head = _linear_head(model)
    with _weight_reads(head):
        _check_head_weight(model, head, at_patch=True)
        _check_head_call(model, head)
        weight = head.weight
    if model.base_model is model:
        raise TypeError(f"patch_causal_lm: {type(model).__name__} has no base model "
                        f"(base_model_prefix={model.base_model_prefix!r})")
    cls_forward = type(model).forward
    signature = inspect.signature(cls_forward)
    if "logits_to_keep" not in signature.parameters:
        raise NotImplementedError(
            f"patch_causal_lm: {type(model).__name__}.forward has no `logits_to_keep` argument "
            f"(transformers too old?); cannot skip the logits")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        raise NotImplementedError(f"patch_causal_lm: {type(model).__name__}.forward takes no "
                                  f"**kwargs (no num_items_in_batch)")
    # Catch a misspelled tuning keyword now rather than at the first training step. With
    # backend=None the weights may still move (patched on the CPU, trained on a GPU): either
    # torch-side backend's keywords are accepted, as the front door accepts them.
    if backend is None:
        impl_backend, accepted = None, lt._tuning_names(None)
    else:
        impl_backend, impl = lt._resolve(backend, weight.device, weight.dtype)
        accepted = impl.TUNING
    unknown = sorted(set(tuning) - set(accepted))
    if unknown:
        raise TypeError(f"patch_causal_lm: unknown tuning keyword(s) {unknown} for "
                        f"backend={impl_backend!r}")
    had_instance_forward = "forward" in model.__dict__  # e.g. accelerate's device-map hooks
    state = _State(softcap_attr=SUPPORTED_MODEL_TYPES[model_type], fuse_in_eval=fuse_in_eval,
                   backend=backend, tuning=dict(tuning),
                   had_instance_forward=had_instance_forward, inner_forward=model.forward,
                   signature=signature)
    object.__setattr__(model, _STATE, state)
    base = model.base_model
    object.__setattr__(base, _SLOT, [])   # off (empty) unless a fused call is running
    state.hook_id = base.register_forward_hook(_keep_hidden).id
    # A bound method of a function that holds no reference to the model: copy.deepcopy
    # rebinds it to the copy. It carries the class forward's signature (the Trainer reads it).
    state.patched_func = _make_forward(cls_forward, signature)
    model.forward = types.MethodType(state.patched_func, model)
    return model


def _linear_head(model):
    """The LM head, if it computes exactly ``F.linear(x, weight, bias)`` (read at every call:
    a head wrapped after patching, e.g. by PEFT's LoRA, has a ``.weight`` too)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise TypeError(f"patch_causal_lm: the model's output embedding must be a plain "
                        f"torch.nn.Linear, got {type(head).__name__} (e.g. a PEFT-wrapped head)")
    return head


def _offloads(hook) -> bool:
    """Whether an accelerate hook (``module._hf_hook``) offloads the module's weights:
    ``AlignDevicesHook(offload=True)`` keeps them on the meta device outside the module's
    forward; a ``SequentialHook`` chains hooks in ``.hooks``."""
    if hook is None:
        return False
    return bool(getattr(hook, "offload", False)) or any(_offloads(h)
                                                        for h in getattr(hook, "hooks", ()))


def _check_head_weight(model, head, *, at_patch: bool):
    """Refuse a head weight the fused loss cannot read as the head's full matrix: the loss
    bypasses the head's forward, where accelerate loads an offloaded weight and where tensor
    parallelism computes on the local shard. Attribute checks only (no host sync): this
    runs at every fused call, as offloading or sharding may be set up after patching."""
    w = head.weight
    offloaded = _offloads(getattr(head, "_hf_hook", None))
    # At patch time only a hook that offloads is refused: a meta weight without one may be
    # materialised later (meta-device init, then to_empty / loading).
    if offloaded if at_patch else w.is_meta:
        cause = ("accelerate offloads it (device_map with CPU/disk offload, cpu_offload) and "
                 "loads it only inside the head's own forward, which the fused loss bypasses"
                 if offloaded else
                 "offloaded, e.g. by accelerate, or never materialised")
        raise RuntimeError(
            f"patch_causal_lm: {type(model).__name__}'s lm_head weight is on the meta device "
            f"({cause}); the fused loss reads the weight directly: keep the head on a GPU "
            f"(e.g. a device_map / max_memory that does not offload lm_head), or "
            f"unpatch_causal_lm(model)")
    # By the module: a DTensor exists only once torch.distributed.tensor is imported (and
    # importing it here would cost every call).
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(w, dtensor.DTensor):
        # At patch time (outside any forward) a DTensor on a head that nothing wraps is
        # FSDP2's, of this model or of an outer root (e.g. a PeftModel): the root's forward
        # gathers it before the call, where this check runs again. Tensor parallelism always
        # wraps the head (tp_forward / hooks).
        if at_patch and "forward" not in head.__dict__ and not _head_hooks(head):
            return
        raise RuntimeError(
            f"patch_causal_lm: {type(model).__name__}'s lm_head weight is a DTensor (placements "
            f"{tuple(w.placements)} on {w.device_mesh}) when the fused loss reads it: "
            f"the head is sharded by tensor parallelism (transformers' tp_plan) or by an FSDP2 "
            f"unit of its own, and the loss bypasses the head's forward. A vocab-sharded head "
            f"needs the vocab-parallel loss on its local shard, "
            f"logitless.torch.linear_cross_entropy(hidden, weight.to_local(), labels, "
            f"process_group=tp_group, vocab_start_index=..., vocab_size=...), not this patch; "
            f"with FSDP2, shard the head with the root module; or unpatch_causal_lm(model)")
    # At patch time a wrapper may still hold the weight sharded (FSDP1 keeps a flat 1-D shard
    # view outside its forward); the loss's contract is the model's own: config.vocab_size rows
    # (ForCausalLMLoss views the logits as (-1, config.vocab_size)).
    vocab = getattr(model.config, "vocab_size", None) or head.out_features
    if not at_patch and tuple(w.shape) != (vocab, head.in_features):
        raise RuntimeError(
            f"patch_causal_lm: {type(model).__name__}'s lm_head weight has shape "
            f"{tuple(w.shape)}, not (config.vocab_size, in_features) = ({vocab}, "
            f"{head.in_features}), when the fused loss reads it (a tensor-parallel local shard, "
            f"or one a wrapper did not gather?): the loss needs the full vocabulary; a "
            f"vocab-sharded head needs logitless.torch.linear_cross_entropy(..., "
            f"process_group=...)")


def _hook_dicts(head):
    """(kind, dict) of the hooks registered on the head itself (the *_with_kwargs and
    always_call variants are flags on hooks kept in these dicts)."""
    return (("forward pre-hook", head._forward_pre_hooks), ("forward hook", head._forward_hooks),
            ("backward pre-hook", head._backward_pre_hooks),
            ("backward hook", head._backward_hooks))


def _head_hooks(head):
    """Whether any hook is registered on the head itself."""
    return any(hooks for _, hooks in _hook_dicts(head))


def _check_head_call(model, head):
    """Refuse what changes the head's computation on the instance: the fused loss reads
    ``head.weight`` and bypasses the head's forward (the model's forward calls the head on an
    empty slice only). Python attribute checks only: this runs at every fused call (traced by
    torch.compile), as a hook or wrapper may be added after patching. (A hook added after
    torch.compile traced the call goes unseen, as it does unpatched: dynamo does not guard on
    module hooks, ``torch._dynamo.config.skip_nnmodule_hook_guards``.)"""
    kinds = _hook_dicts(head)
    found = []
    if any(hooks for _, hooks in kinds):
        found = [f"{kind} {_name(h)}" for kind, hooks in kinds for h in hooks.values()
                 if not (kind == "forward pre-hook" and _recomputes_weight(h))]
    if found:
        raise RuntimeError(
            f"patch_causal_lm: {type(model).__name__}'s lm_head has hooks ({', '.join(found)}): "
            f"the fused loss reads lm_head.weight directly and the head runs only on an empty "
            f"slice, so a hook sees no logits and what it changes never reaches the loss (and a "
            f"hook that gathers a sharded weight, as DeepSpeed ZeRO-3's or an FSDP unit of the "
            f"head's own, gathers it for that call only). Remove them (handle.remove()), or "
            f"unpatch_causal_lm(model) to use the model's own loss")
    forward = head.__dict__.get("forward")
    if forward is None or _is_own_forward(head, forward) or _is_device_hook(head, forward):
        return
    if _is_accelerate_wrapper(head, forward):
        old = head.__dict__.get("_old_forward")
        what = (f"accelerate's {_hook_name(head.__dict__.get('_hf_hook'))} around "
                f"{_name(old)}")
    else:
        what = f"{_name(forward)}, a {type(forward).__name__}"
    raise RuntimeError(
        f"patch_causal_lm: {type(model).__name__}'s lm_head.forward is replaced on the instance "
        f"({what}): the fused loss reads lm_head.weight directly and bypasses it (of accelerate's "
        f"hooks, only AlignDevicesHook without offload is reproduced). Remove the wrapper "
        f"(del lm_head.forward; accelerate's remove_hook_from_module), or "
        f"unpatch_causal_lm(model) to use the model's own loss")


# torch's forward pre-hooks that only set the head's weight attribute from other parameters
# before each forward (the legacy, non-parametrize weight_norm and spectral_norm; pruning):
# the model's forward calls the head (on the empty slice) before the loss reads lm_head.weight,
# so the loss reads the weight of this call, as the head's own forward would.
_WEIGHT_PRE_HOOKS = (WeightNorm, SpectralNorm, prune.BasePruningMethod)


def _recomputes_weight(hook):
    cls = type(hook)
    return (isinstance(hook, _WEIGHT_PRE_HOOKS)
            and any(cls.__call__ is base.__call__ for base in _WEIGHT_PRE_HOOKS))


def _name(f):
    return getattr(f, "__qualname__", None) or type(f).__name__


def _hook_name(hook):
    inner = getattr(hook, "hooks", None)
    if isinstance(inner, (tuple, list)):
        return f"{type(hook).__name__}({', '.join(_hook_name(h) for h in inner)})"
    flags = [f"{k}=True" for k in ("offload", "no_grad") if getattr(hook, k, False) is True]
    return type(hook).__name__ + (f"({', '.join(flags)})" if flags else "")


def _is_own_forward(head, f):
    """``f`` is ``nn.Linear.forward`` bound to ``head`` (what accelerate's
    ``remove_hook_from_module`` leaves in ``head.forward``)."""
    return (isinstance(f, types.MethodType) and f.__self__ is head
            and f.__func__ is torch.nn.Linear.forward)


def _is_accelerate_wrapper(head, forward):
    """``forward`` is accelerate's ``add_hook_to_module`` wrapper of ``head``:
    ``partial(new_forward, head)``, ``new_forward`` a function of accelerate's hooks module
    (by identity of its globals: looked up, not imported, as without accelerate there is no
    such hook) that calls ``head._hf_hook.pre_forward``, ``head._old_forward`` and
    ``head._hf_hook.post_forward``."""
    hooks = sys.modules.get("accelerate.hooks")
    if hooks is None or not isinstance(forward, functools.partial):
        return False
    return (getattr(forward.func, "__globals__", None) is vars(hooks)
            and getattr(forward.func, "__name__", None) == "new_forward"
            and len(forward.args) == 1 and forward.args[0] is head and not forward.keywords)


def _is_device_hook(head, forward):
    """accelerate's wrapper around the head's own forward with device placement only:
    ``AlignDevicesHook(offload=False)`` (exactly that class: a subclass may edit the output),
    alone or chained in ``SequentialHook``s. Its ``pre_forward`` moves the input to the
    head's device, as the patch does; ``no_grad`` must be off (else the head gives no
    gradient)."""
    if not (_is_accelerate_wrapper(head, forward)
            and _is_own_forward(head, head.__dict__.get("_old_forward"))):
        return False
    hooks = sys.modules["accelerate.hooks"]
    todo = [head.__dict__.get("_hf_hook")]
    while todo:
        hook = todo.pop()
        if type(hook) is getattr(hooks, "SequentialHook", None):
            todo.extend(hook.hooks)
        elif (type(hook) is not getattr(hooks, "AlignDevicesHook", None) or hook.offload
              or hook.no_grad):
            return False
    return True


def _weight_reads(head):
    """A parametrized head weight (``torch.nn.utils.parametrize``: weight norm, spectral
    norm) is computed at every read of ``head.weight``; the fused call reads it more than once
    (the checks, the head's call on the empty slice, the loss). Read once, as the head's own
    forward does: spectral norm's power iteration steps at each read in training mode. The
    cache holds for the whole call, so another parametrized module read twice in one forward
    is computed once too."""
    return parametrize.cached() if parametrize.is_parametrized(head) else contextlib.nullcontext()


def _check_own_loss(model, model_type):
    """The forward and the loss replaced must be transformers' own: a subclass that overrides
    ``forward`` (e.g. adds an auxiliary term) or a custom ``loss_function`` / ``loss_type``
    would otherwise be dropped silently."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    owner = next(c for c in type(model).__mro__ if "forward" in c.__dict__)
    expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if owner.__name__ != expected or not owner.__module__.startswith("transformers.models."):
        raise NotImplementedError(
            f"patch_causal_lm: the forward of {type(model).__name__} is {owner.__module__}."
            f"{owner.__qualname__}, not transformers' {expected}.forward: its loss may differ")
    try:  # transformers >= 4.46 computes the loss through model.loss_function
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return
    loss_function = getattr(model, "loss_function", ForCausalLMLoss)
    if loss_function is not ForCausalLMLoss:
        raise NotImplementedError(f"patch_causal_lm: {type(model).__name__}.loss_function is "
                                  f"{loss_function!r}, not transformers' ForCausalLMLoss")


def unpatch_causal_lm(model):
    """Undo :func:`patch_causal_lm` (a no-op for a model that is not patched).

    If ``model.forward`` was wrapped after patching by accelerate's ``add_hook_to_module``
    (which keeps the forward it wraps as ``model._old_forward`` and calls it from there), the
    patch is removed underneath the hook, which stays. Any other replacement of
    ``model.forward`` since patching raises ``RuntimeError`` and leaves the model as it is:
    restoring the pre-patch forward would drop that wrapper, and keeping it would leave it
    calling the patch."""
    state = model.__dict__.get(_STATE)
    if state is None:
        return model

    def is_patch(f):
        return (isinstance(f, types.MethodType) and f.__self__ is model
                and f.__func__ is state.patched_func)

    current = model.__dict__.get("forward")
    if is_patch(current):
        if state.had_instance_forward:
            model.forward = state.inner_forward
        else:
            del model.forward
    elif is_patch(model.__dict__.get("_old_forward")):
        # the hook's wrapper looks model._old_forward up at every call, and accelerate's
        # remove_hook_from_module restores it as model.forward: the pre-patch forward either way
        model._old_forward = state.inner_forward
    else:
        now = "the class's forward" if current is None else f"a {type(current).__name__}"
        how = "Remove the wrapper first (restore the forward it replaced), then unpatch"
        if is_patch(model.__dict__.get("_original_forward")):
            # accelerate's mixed-precision wrapper (Accelerator.prepare, a Trainer with bf16)
            how = ("It is accelerate's mixed-precision wrapper (Accelerator.prepare): "
                   "accelerator.unwrap_model(model, keep_fp32_wrapper=False) first, then unpatch")
        raise RuntimeError(
            f"unpatch_causal_lm: {type(model).__name__}.forward was replaced after "
            f"patch_causal_lm (now {now}); unpatching would drop that wrapper or leave it "
            f"calling the patch. {how}")
    model.base_model._forward_hooks.pop(state.hook_id, None)
    model.base_model.__dict__.pop(_SLOT, None)
    object.__delattr__(model, _STATE)
    return model


def is_patched(model) -> bool:
    """Whether :func:`patch_causal_lm` patched this model instance (and it was not undone)."""
    return _STATE in getattr(model, "__dict__", {})


def _make_forward(cls_forward, signature):
    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        return _patched_forward(self, args, kwargs)
    # no __wrapped__: accelerate's unwrap_model(keep_fp32_wrapper=False) walks __wrapped__ and
    # would stop past the patch (at the class's forward); the Trainer reads __signature__
    del forward.__wrapped__
    forward.__signature__ = signature
    return forward


def _patched_forward(model, args, kwargs):
    state: _State = model.__dict__[_STATE]
    bound = state.signature.bind(model, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop(next(iter(state.signature.parameters)))  # self
    var_kw_name = next(p.name for p in state.signature.parameters.values()
                       if p.kind is inspect.Parameter.VAR_KEYWORD)
    extra = dict(named.pop(var_kw_name, {}))
    labels = named.get("labels")
    shift_labels = extra.get("shift_labels")
    keep = named.get("logits_to_keep", 0)
    fuse = (labels is not None  # the model's own forward computes a loss only then
            and (model.training or state.fuse_in_eval)
            and isinstance(keep, int) and keep == 0)
    if not fuse:
        return state.inner_forward(*args, **kwargs)

    named.pop("labels", None)
    extra.pop("shift_labels", None)
    num_items_in_batch = extra.pop("num_items_in_batch", None)
    ignore_index = extra.pop("ignore_index", -100)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    head = _linear_head(model)
    named["logits_to_keep"] = slice(0, 0)  # hidden[:, 0:0]: no index tensor (device-free)
    with _weight_reads(head):
        # before the model's forward runs
        _check_head_weight(model, head, at_patch=False)
        _check_head_call(model, head)
        slot = model.base_model.__dict__[_SLOT]
        slot.append(True)
        try:
            out = state.inner_forward(**named, **extra, return_dict=True)
            captured = slot[1:]
        finally:
            slot.clear()
        if not captured:
            raise RuntimeError(
                f"patch_causal_lm: {type(model).__name__}'s base model was not called")
        hidden = captured[-1]
        if shift_labels is None:
            # As transformers' ForCausalLMLoss: position t predicts label t+1, the last
            # predicts nothing (padded with ignore_index), so every hidden state is used.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        softcap = getattr(model.config, state.softcap_attr) if state.softcap_attr else None
        loss = causal_lm_loss(hidden, head.weight, shift_labels, bias=head.bias,
                              num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                              softcap=softcap, backend=state.backend, **state.tuning)
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    if return_dict:
        return type(out)(loss=loss, **fields)
    # to_tuple() drops None fields: keep the logits' place, so that `loss, logits = out[:2]`
    # gets None rather than the next field (the cache)
    return (loss, None) + type(out)(**fields).to_tuple()


def causal_lm_loss(hidden, lm_head_weight, shift_labels, *, bias=None, num_items_in_batch=None,
                   ignore_index=-100, softcap=None, backend=None, **tuning):
    """``transformers``' ``ForCausalLMLoss`` on ``hidden @ lm_head_weight.T (+ bias)`` without
    the logits: ``shift_labels`` already shifted (shaped like ``hidden.shape[:-1]``, or flattened
    as transformers accepts); ``sum / num_items_in_batch`` when it is given
    (an int or a tensor: no host sync), else the mean over non-ignored tokens."""
    # the head's device, as accelerate's hook on lm_head moves them (device_map="auto" may
    # put the final norm and the head on different GPUs)
    x, w, b = hidden.to(lm_head_weight.device), lm_head_weight, bias
    # Under autocast the front door casts all three as F.linear would; without it, hidden
    # states in another dtype than the head (e.g. an fp32 final norm) go to the head's dtype.
    if not torch.is_autocast_enabled(x.device.type) and x.dtype != w.dtype:
        x = x.to(w.dtype)
    reduction = "mean" if num_items_in_batch is None else "sum"
    # transformers flattens shift_labels (``view(-1)``), so a (B·T,) tensor is accepted too
    y = shift_labels.reshape(x.shape[:-1]) if shift_labels.numel() == x.shape[:-1].numel() \
        else shift_labels
    loss = lt.linear_cross_entropy(x, w, y.to(x.device), linear_bias=b,
                                   reduction=reduction, ignore_index=ignore_index,
                                   softcap=softcap, backend=backend, **tuning)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
