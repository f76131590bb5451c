"""Hugging Face transformers integration: tiny random-initialised causal LMs from
``transformers`` train patched and unpatched with matching losses and parameters; gradient
accumulation with ``num_items_in_batch``; the logits are never made; the untouched paths stay
untouched."""
import copy
import inspect
import sys
import types

import pytest
import torch
import transformers

from harness import SEED
from logitless.integrations.transformers import (SUPPORTED_MODEL_TYPES, causal_lm_loss,
                                                 is_patched, patch_causal_lm, unpatch_causal_lm)

V = 251          # prime: no block divides it
H = 48
T = 23
B = 3
CHUNK = 16       # tokens per chunk of the torch backend: B*T = 69 tokens -> 5 chunks, ragged

COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # a small cap, so that it bites
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=12,
                                                final_logit_softcapping=2.0,
                                                query_pre_attn_scalar=12, sliding_window=8),
    "mistral": lambda: transformers.MistralConfig(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=12),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=12),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=12,
                                                        final_logit_softcapping=2.0,
                                                        query_pre_attn_scalar=12,
                                                        sliding_window=8),
    "phi3": lambda: transformers.Phi3Config(**COMMON, pad_token_id=0),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON),
}
TRAINED = ["llama", "qwen2", "gemma2"]


def make_model(kind, seed=0):
    torch.manual_seed(SEED + seed)
    cfg = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    assert model.config.model_type == kind
    with torch.no_grad():  # logits of std ~3, as in a trained LM (the init gives ~0.1)
        model.get_output_embeddings().weight.mul_(25)
    return model.float().train()


def make_batch(seed, *, b=B, t=T, ignore_prefix=True):
    g = torch.Generator().manual_seed(SEED + seed)
    # a learnable sequence (each token the previous one plus 5) from random starts
    start = torch.randint(0, V, (b, 1), generator=g)
    ids = (start + 5 * torch.arange(t)) % V
    labels = ids.clone()
    if ignore_prefix:  # a prompt per row, of varying length: ragged token counts
        for i in range(b):
            labels[i, : int(torch.randint(0, t // 2, (1,), generator=g))] = -100
    mask = torch.ones(b, t, dtype=torch.long)
    return ids, mask, labels


def test_supported_types_are_tested():
    assert set(SUPPORTED_MODEL_TYPES) == set(CONFIGS)


@pytest.mark.parametrize("kind", TRAINED)
def test_ten_training_steps_match_unpatched(kind):
    """Ten AdamW steps of the patched model; at every step the unpatched model, loaded with the
    same parameters, gives the same loss and the same gradients. (Comparing two independent
    trajectories was chaotic: Adam divides by sqrt(v), so a coordinate whose gradient is ~0
    steps either way on rounding noise, by up to lr, and the losses drifted apart by 3e-5 to
    4e-3 relative at 2 of 20 seeds, on the old code too.)"""
    fused = patch_causal_lm(make_model(kind), chunk_size=CHUNK)
    ref = make_model(kind)
    assert is_patched(fused) and not is_patched(ref)
    opt = torch.optim.AdamW(fused.parameters(), lr=3e-3)
    head = fused.get_output_embeddings().weight
    head_0, head_grads = head.detach().clone(), []
    for step in range(10):
        ids, mask, labels = make_batch(step)
        ref.load_state_dict(fused.state_dict())
        for model in (fused, ref):
            model.zero_grad(set_to_none=True)
        out_f = fused(input_ids=ids, attention_mask=mask, labels=labels)
        out_f.loss.backward()
        out_r = ref(input_ids=ids, attention_mask=mask, labels=labels)
        out_r.loss.backward()
        torch.testing.assert_close(out_f.loss, out_r.loss, rtol=2e-5, atol=0)
        for (name, p_f), (_, p_r) in zip(fused.named_parameters(), ref.named_parameters()):
            _assert_grads_close(p_f.grad, p_r.grad, f"step {step} {name}")
        head_grads.append(head.grad.norm().item())
        opt.step()
    # not vacuous: the head's gradients compared were not zero and the steps moved it (whether
    # ten steps lower the loss depends on the seed: qwen2's tied, scaled embedding made the
    # loss rise at 1 of 13 seeds, where every step's loss and gradients still matched)
    assert min(head_grads) > 1e-3, head_grads
    moved = ((head.detach() - head_0).norm() / head_0.norm()).item()
    assert moved > 1e-2, moved


def _assert_grads_close(got, want, name):
    """fp32 gradients summed in another order: norm-wise within 1e-5 (element-wise bounds
    trip on the odd small element, ~1e-6 off, at some seeds)."""
    assert got.shape == want.shape and torch.isfinite(got).all(), name
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= 1e-5, f"{name}: rel err {err:.3g}"


def _assert_same_step(ref, fused, ids, mask, labels):
    """One training step of the unpatched ``ref`` and the patched ``fused``: the same loss
    (the fused one without logits) and the same gradient for every parameter."""
    out_r = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_f = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert out_f.logits is None
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    out_r.loss.backward()
    out_f.loss.backward()
    for (name, p_r), (_, p_f) in zip(ref.named_parameters(), fused.named_parameters()):
        _assert_grads_close(p_f.grad, p_r.grad, name)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_loss_and_grads_match_every_supported_type(kind):
    ref = make_model(kind, seed=1)
    fused = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    _assert_same_step(ref, fused, *make_batch(100))


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_softcap_is_applied(kind):
    """Negative control: the cap changes the loss by far more than the tolerance above, so
    the matching losses of the other tests do depend on it."""
    model = make_model(kind, seed=2)
    ids, mask, labels = make_batch(7)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    patch_causal_lm(model)
    capped = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    model.config.final_logit_softcapping = None
    uncapped = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(capped, ref, rtol=1e-5, atol=0)
    assert abs(uncapped.item() - ref.item()) > 1e-3 * abs(ref.item())


class _Linears(torch.overrides.TorchFunctionMode):
    """Records the output shapes of F.linear calls on one weight (the head's own call included:
    a hook on the head would now be refused by the patch)."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.shapes = weight, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and args[1] is self.weight:
            self.shapes.append(out.shape)
        return out


def test_logits_never_materialized():
    """No tensor with tokens x vocab elements is computed by the head or saved for backward."""
    model = patch_causal_lm(make_model("llama"), chunk_size=CHUNK)
    ids, mask, labels = make_batch(3)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _Linears(model.lm_head.weight) as linears:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert linears.shapes[0] == torch.Size([B, 0, V])  # the head's call, on the empty slice
    assert max(s.numel() for s in linears.shapes) < B * T * V
    assert saved and max(saved) < B * T * V
    # the negative control: unpatched, the head does make them
    unpatch_causal_lm(model)
    with _Linears(model.lm_head.weight) as linears:
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert linears.shapes == [torch.Size([B, T, V])]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_gradient_accumulation_with_num_items_in_batch(kind):
    """Two micro-batches with different numbers of label tokens, each normalised by the total
    (what the Trainer passes), accumulate to the full batch's mean-loss gradient; patched and
    unpatched agree, with num_items_in_batch as a tensor or an int."""
    ref = make_model(kind, seed=3)
    fused = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    full = make_batch(11, b=4)
    micro = [tuple(t[:1] for t in full), tuple(t[1:] for t in full)]
    n_items = (full[2][:, 1:] != -100).sum()
    assert (micro[0][2][:, 1:] != -100).sum() != (micro[1][2][:, 1:] != -100).sum()

    def accumulate(model, as_int):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for ids, mask, labels in micro:
            n = int(n_items) if as_int else n_items
            loss = model(input_ids=ids, attention_mask=mask, labels=labels,
                         num_items_in_batch=n).loss
            loss.backward()
            total += loss.item()
        return total, {k: p.grad.clone() for k, p in model.named_parameters()}

    total_r, grads_r = accumulate(ref, as_int=False)
    for as_int in (False, True):
        total_f, grads_f = accumulate(fused, as_int)
        assert total_f == pytest.approx(total_r, rel=1e-5)
        for k in grads_r:
            _assert_grads_close(grads_f[k], grads_r[k], k)
    # ... and equal the full batch's plain mean loss (the point of num_items_in_batch)
    fused.zero_grad(set_to_none=True)
    loss_full = fused(input_ids=full[0], attention_mask=full[1], labels=full[2]).loss
    loss_full.backward()
    assert loss_full.item() == pytest.approx(total_r, rel=1e-5)
    for k, p in fused.named_parameters():
        _assert_grads_close(p.grad, grads_r[k], k)


def test_shift_labels_and_ignore_index_kwargs():
    ref = make_model("qwen2", seed=4)
    fused = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    ids, mask, labels = make_batch(5)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    a = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    # shift_labels take the place of labels, which must be given too (as for transformers)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shifted).loss
    torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    # flattened (B·T,) shift_labels, as packing collators pass them: transformers views them
    flat = fused(input_ids=ids, attention_mask=mask, labels=labels,
                 shift_labels=shifted.reshape(-1)).loss
    torch.testing.assert_close(flat, a, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="target must have shape"):
        fused(input_ids=ids, attention_mask=mask, labels=labels, shift_labels=shifted[:, 1:])
    # shift_labels alone: no loss, the logits, as the unpatched model (a Trainer with a
    # compute_loss_func pops labels and reads the logits)
    alone, want = (m(input_ids=ids, attention_mask=mask, shift_labels=shifted) for m in (fused, ref))
    assert alone.loss is None and want.loss is None
    torch.testing.assert_close(alone.logits, want.logits, rtol=0, atol=0)
    # a different ignore_index, as the loss kwargs allow
    relabelled = torch.where(labels == -100, torch.full_like(labels, -1), labels)
    c = ref(input_ids=ids, attention_mask=mask, labels=relabelled, ignore_index=-1).loss
    d = fused(input_ids=ids, attention_mask=mask, labels=relabelled, ignore_index=-1).loss
    torch.testing.assert_close(d, c, rtol=1e-5, atol=0)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=0)


def test_untouched_paths_and_outputs():
    ref = make_model("llama", seed=5)
    fused = patch_causal_lm(copy.deepcopy(ref))
    ids, mask, labels = make_batch(6)
    # no labels: the model's own forward (generation, inference), identical logits
    torch.testing.assert_close(fused(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=0, atol=0)
    # eval mode keeps the logits (metrics) unless fuse_in_eval
    fused.eval()
    ref.eval()
    with torch.no_grad():
        out = fused(input_ids=ids, labels=labels)
        assert out.logits.shape == (B, T, V)
        patch_causal_lm(fused, fuse_in_eval=True)
        fused.eval()
        out2 = fused(input_ids=ids, labels=labels)
        assert out2.logits is None
        torch.testing.assert_close(out2.loss, ref(input_ids=ids, labels=labels).loss,
                                   rtol=1e-5, atol=0)
    fused.train()
    ref.train()
    # positional labels, return_dict=False, hidden states still returned
    params = list(inspect.signature(fused.forward).parameters)
    assert params[0] == "input_ids" and "labels" in params  # the Trainer reads this
    args = [ids, mask] + [None] * (params.index("labels") - 2) + [labels]
    tup = fused(*args, return_dict=False, output_hidden_states=True)
    want = ref(*args, return_dict=False, output_hidden_states=True)
    torch.testing.assert_close(tup[0], want[0], rtol=1e-5, atol=0)
    # the logits keep their place (None): every later field where the unpatched model has it
    assert len(tup) == len(want) and tup[1] is None and want[1].shape == (B, T, V)
    for a, b in zip(tup[2:], want[2:]):
        assert type(a) is type(b)
    out = fused(input_ids=ids, labels=labels, output_hidden_states=True)
    assert out.logits is None and len(out.hidden_states) == ref.config.num_hidden_layers + 1


def test_unpatch_deepcopy_and_errors():
    model = make_model("llama", seed=6)
    cls_forward = type(model).forward
    patch_causal_lm(model)
    clone = copy.deepcopy(model)
    assert is_patched(clone) and clone.forward.__self__ is clone
    ids, mask, labels = make_batch(8)
    # the copy runs its own weights, not the original's
    with torch.no_grad():
        clone.lm_head.weight.mul_(0)
    torch.testing.assert_close(clone(input_ids=ids, labels=labels).loss,
                               torch.log(torch.tensor(float(V))), rtol=1e-5, atol=0)
    assert model(input_ids=ids, labels=labels).loss.item() != pytest.approx(float(
        torch.log(torch.tensor(float(V)))), rel=1e-3)
    unpatch_causal_lm(model)
    assert not is_patched(model) and "forward" not in model.__dict__
    assert model.forward.__func__ is cls_forward
    with pytest.raises(TypeError, match="chunk_sise"):
        patch_causal_lm(model, chunk_sise=4)
    with pytest.raises(ValueError, match="backend"):
        patch_causal_lm(model, backend="cuda")
    assert not is_patched(model)
    moe = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        **COMMON, num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(NotImplementedError, match="mixtral"):
        patch_causal_lm(moe)


def test_only_transformers_own_forward_loss_and_head_are_replaced():
    """What the patch would drop silently is refused: a subclass overriding forward (an extra
    loss term), a custom loss_function, a head that is not a plain nn.Linear (a LoRA wrapper
    added after patching too: it keeps a .weight)."""
    ids, mask, labels = make_batch(10)

    class Extra(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            if out.loss is not None:
                out["loss"] = out.loss + 1.0
            return out
    extra = Extra(CONFIGS["llama"]())
    with pytest.raises(NotImplementedError, match="forward of Extra"):
        patch_causal_lm(extra)
    custom = make_model("llama", seed=11)
    custom.loss_function = lambda *a, **k: torch.zeros(())
    with pytest.raises(NotImplementedError, match="loss_function"):
        patch_causal_lm(custom)

    class Halved(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5
    halved = make_model("llama", seed=12)
    head = halved.lm_head
    halved.lm_head = Halved(H, V, bias=False)
    halved.lm_head.weight = head.weight
    with pytest.raises(TypeError, match="plain torch.nn.Linear, got Halved"):
        patch_causal_lm(halved)
    wrapped = patch_causal_lm(make_model("llama", seed=13))

    class Lora(torch.nn.Module):  # a .weight like the head's, plus a delta it would lose
        def __init__(self, base):
            super().__init__()
            self.base, self.weight = base, base.weight
            self.a = torch.nn.Parameter(torch.randn(4, H) * 0.1)
            self.b = torch.nn.Parameter(torch.randn(V, 4) * 0.1)

        def forward(self, x):
            return self.base(x) + x @ self.a.t() @ self.b.t()
    wrapped.lm_head = Lora(wrapped.lm_head)
    with pytest.raises(TypeError, match="got Lora"):
        wrapped(input_ids=ids, attention_mask=mask, labels=labels)


def test_patch_on_cpu_for_the_gpu_and_compile_fullgraph():
    """Patching a model still on the CPU with a Triton keyword (the Trainer moves it later)
    works as the front door does; the patched training step compiles with fullgraph=True (a
    hook registered per call had broken the graph) and gives the eager loss."""
    model = patch_causal_lm(make_model("llama", seed=14), low_memory=True, chunk_size=CHUNK)
    ids, mask, labels = make_batch(15)
    eager = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    step = torch.compile(lambda i, m, y: model(input_ids=i, attention_mask=m, labels=y).loss,
                         backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(step(ids, mask, labels), eager, rtol=1e-5, atol=0)


def test_causal_lm_loss_under_autocast():
    """Under autocast the fused loss computes in the autocast dtype, as the head would."""
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(2, 7, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g) * 0.3
    y = torch.randint(0, V, (2, 7), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = causal_lm_loss(hidden, w, y)
        ref = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden, w).float().flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ref, rtol=2e-3, atol=0)
    loss.backward()
    assert hidden.grad.dtype == torch.float32 and torch.isfinite(hidden.grad).all()


# ---------------------------------------------------------------- accelerate, TP, FSDP2
# accelerate's hooks module (src/accelerate/hooks.py, 1.x), re-told (accelerate is not a test
# dependency) with the same names and attributes, and run as a module named accelerate.hooks:
# the patch recognises add_hook_to_module's wrapper by the globals of that module (in
# sys.modules once accelerate is imported; the `accelerate_hooks` fixture puts this one there).
# Checked against accelerate 1.15.0 itself (dispatch_model, AlignDevicesHook with and without
# offload, SequentialHook, a user ModelHook, LayerwiseCastingHook, cpu_offload,
# remove_hook_from_module): the patch accepts and refuses the same hooks as here.
_ACCELERATE_HOOKS = """
import functools
import torch


class ModelHook:
    no_grad = False

    def init_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def detach_hook(self, module):
        return module


class SequentialHook(ModelHook):
    def __init__(self, *hooks):
        self.hooks = hooks

    def init_hook(self, module):
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module, *args, **kwargs):
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output


class AlignDevicesHook(ModelHook):
    # offload=True: the module's weight stays on the meta device outside its forward;
    # pre_forward loads it from weights_map (and moves the inputs to execution_device),
    # post_forward sends it back to meta. `calls` counts pre_forward calls (for the tests).
    def __init__(self, execution_device=None, offload=False, io_same_device=False,
                 weights_map=None, offload_buffers=False, place_submodules=False):
        self.execution_device, self.offload, self.weights_map = (execution_device, offload,
                                                                  weights_map)
        self.io_same_device, self.offload_buffers = io_same_device, offload_buffers
        self.place_submodules = place_submodules
        self.calls = 0

    def init_hook(self, module):
        if self.offload:
            self.weights_map = {n: p for n, p in module.named_parameters(recurse=False)}
            for n, p in self.weights_map.items():
                module._parameters[n] = torch.nn.Parameter(p.to("meta"), p.requires_grad)
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        if self.offload:
            module._parameters.update(self.weights_map)
        return tuple(a.to(self.execution_device) if torch.is_tensor(a) else a
                     for a in args), kwargs

    def post_forward(self, module, output):
        if self.offload:
            for n, p in self.weights_map.items():
                module._parameters[n] = torch.nn.Parameter(p.to("meta"), p.requires_grad)
        return output


def add_hook_to_module(module, hook, append=False):
    if append and getattr(module, "_hf_hook", None) is not None:
        old_hook = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(old_hook, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        old_forward = module._old_forward
    else:
        old_forward = module.forward
        module._old_forward = old_forward
    module = hook.init_hook(module)
    module._hf_hook = hook

    def new_forward(module, *args, **kwargs):
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        if module._hf_hook.no_grad:
            with torch.no_grad():
                output = module._old_forward(*args, **kwargs)
        else:
            output = module._old_forward(*args, **kwargs)
        return module._hf_hook.post_forward(module, output)

    module.forward = functools.update_wrapper(functools.partial(new_forward, module),
                                              old_forward)
    return module


def remove_hook_from_module(module):
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        module.forward = module._old_forward  # the bound forward stays in module.__dict__
        delattr(module, "_old_forward")
    return module
"""
_accelerate = types.ModuleType("accelerate.hooks")
exec(compile(_ACCELERATE_HOOKS, "<accelerate.hooks, re-told>", "exec"), vars(_accelerate))
_AlignDevicesHook, _add_hook_to_module = (_accelerate.AlignDevicesHook,
                                          _accelerate.add_hook_to_module)


@pytest.fixture
def accelerate_hooks(monkeypatch):
    """accelerate imported: its hooks module in sys.modules for the test's duration."""
    monkeypatch.setitem(sys.modules, "accelerate.hooks", _accelerate)
    return _accelerate


def test_offloaded_head_is_refused():
    """accelerate's CPU/disk offload keeps lm_head.weight on the meta device outside the head's
    forward, which the fused loss bypasses: refused at patch time (the hook says so) and at the
    call (offloading set up after patching), with an error naming the cause. Before, the loss
    was computed on the meta device, silently."""
    ids, mask, labels = make_batch(16)
    ref = make_model("llama", seed=16)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    offloaded = copy.deepcopy(ref)
    _add_hook_to_module(offloaded.lm_head, _AlignDevicesHook("cpu", offload=True))
    assert offloaded.lm_head.weight.is_meta
    # the re-told hook is faithful: the unpatched model runs through it, to the same loss
    torch.testing.assert_close(offloaded(input_ids=ids, attention_mask=mask,
                                         labels=labels).loss, want, rtol=0, atol=0)
    assert offloaded.lm_head._hf_hook.calls == 1 and offloaded.lm_head.weight.is_meta
    with pytest.raises(RuntimeError, match="lm_head weight is on the meta device.*accelerate "
                                           "offloads it"):
        patch_causal_lm(offloaded)
    assert not is_patched(offloaded)
    # offloading set up after patching: refused at the call, before the model's forward runs
    late = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    _add_hook_to_module(late.lm_head, _AlignDevicesHook("cpu", offload=True))
    with pytest.raises(RuntimeError, match="meta device.*accelerate offloads it"):
        late(input_ids=ids, attention_mask=mask, labels=labels)
    assert late.lm_head._hf_hook.calls == 0
    # a meta weight with no hook (meta-device init) is accepted at patch time, refused at the
    # call while still on meta, and used once materialised
    meta_init = copy.deepcopy(ref)
    weight = meta_init.lm_head.weight
    meta_init.lm_head.weight = torch.nn.Parameter(weight.to("meta"))
    patch_causal_lm(meta_init, chunk_size=CHUNK)
    with pytest.raises(RuntimeError, match="meta device .offloaded, e.g. by accelerate, or never"):
        meta_init(input_ids=ids, attention_mask=mask, labels=labels)
    meta_init.lm_head.weight = weight
    torch.testing.assert_close(meta_init(input_ids=ids, attention_mask=mask,
                                         labels=labels).loss, want, rtol=1e-5, atol=0)


def _tensor_parallel(model, mesh):
    """Shard ``model`` as ``from_pretrained(..., tp_plan="auto")`` does (lm_head:
    "colwise_gather_output", a Shard(0) DTensor weight); torch's own ColwiseParallel where this
    transformers has no ``apply_tensor_parallelism``."""
    try:
        from transformers.integrations.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        return parallelize_module(model, mesh, {"lm_head": ColwiseParallel(
            output_layouts=Replicate())})
    return apply_tensor_parallelism(model, mesh)


def test_tensor_parallel_and_fsdp2_heads():
    """A tensor-parallel head (a real DTensor weight, on a 1-process gloo group) is refused at
    patch time, and at the call when sharded after patching, with an error pointing to the
    vocab-parallel loss (before: an obscure sharding-propagation error from the model's
    forward); a plain local shard of the head is refused too. An FSDP2 root's DTensor
    parameters are accepted at patch time: its forward gathers them, and the loss matches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    ids, mask, labels = make_batch(17)
    ref = make_model("llama", seed=17)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        tp = _tensor_parallel(copy.deepcopy(ref), mesh)
        assert isinstance(tp.lm_head.weight, DTensor)
        assert tp.lm_head.weight.placements == (Shard(0),)
        # unpatched, the sharded model computes the reference loss
        torch.testing.assert_close(tp(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   ref(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   rtol=1e-5, atol=0)
        refused = r"lm_head weight is a DTensor .*tensor parallelism.*process_group="
        with pytest.raises(RuntimeError, match=refused):
            patch_causal_lm(tp)
        assert not is_patched(tp)
        late = patch_causal_lm(copy.deepcopy(ref))
        _tensor_parallel(late, mesh)
        with pytest.raises(RuntimeError, match=refused):
            late(input_ids=ids, attention_mask=mask, labels=labels)

        fsdp = copy.deepcopy(ref)
        fully_shard(fsdp, mesh=mesh)
        assert isinstance(fsdp.lm_head.weight, DTensor)
        patch_causal_lm(fsdp, chunk_size=CHUNK)
        ref.zero_grad(set_to_none=True)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels)
        got = fsdp(input_ids=ids, attention_mask=mask, labels=labels)
        assert got.logits is None
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
        got.loss.backward()
        want.loss.backward()
        _assert_grads_close(fsdp.lm_head.weight.grad.full_tensor(), ref.lm_head.weight.grad,
                            "lm_head.weight")
        # FSDP2 at an outer root (a PeftModel under accelerate's FSDP2), the inner model
        # patched: its head holds a DTensor at patch time, gathered by the outer forward
        class Outer(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, **kw):
                return self.m(**kw)
        outer = Outer(copy.deepcopy(ref))
        fully_shard(outer, mesh=mesh)
        assert isinstance(outer.m.lm_head.weight, DTensor)
        patch_causal_lm(outer.m, chunk_size=CHUNK)
        got = outer(input_ids=ids, attention_mask=mask, labels=labels)
        assert got.logits is None
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    finally:
        dist.destroy_process_group()
    # a local shard as a plain tensor (a hand-rolled TP): not the full vocabulary
    shard = patch_causal_lm(copy.deepcopy(ref))
    shard.lm_head.weight = torch.nn.Parameter(shard.lm_head.weight.detach()[: V // 2])
    with pytest.raises(RuntimeError, match=rf"shape \({V // 2}, {H}\), not .*\({V}, {H}\)"):
        shard(input_ids=ids, attention_mask=mask, labels=labels)


def test_head_weights_checked_when_the_loss_reads_them():
    """The weight's shape is checked when the loss reads it, against config.vocab_size (what
    the model's own loss views the logits as): a wrapper may hold a flat shard at patch time
    (FSDP1 outside its forward), and a hand-grown vocabulary leaves out_features stale."""
    ids, mask, labels = make_batch(19)
    ref = make_model("llama", seed=19)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    # a flat shard at patch time (as FSDP1 keeps it), the full weight again at the call
    model = copy.deepcopy(ref)
    full = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(full.detach().reshape(-1)[:0])
    patch_causal_lm(model, chunk_size=CHUNK)
    model.lm_head.weight = full
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               want, rtol=1e-5, atol=0)
    # a vocabulary grown by hand: 8 more rows, config.vocab_size updated, out_features not
    grown = copy.deepcopy(ref)
    extra = torch.randn(8, H, generator=torch.Generator().manual_seed(19)) * 0.02
    grown.lm_head.weight = torch.nn.Parameter(torch.cat([grown.lm_head.weight.detach(), extra]))
    grown.config.vocab_size = V + 8
    want_grown = grown(input_ids=ids, attention_mask=mask, labels=labels).loss
    patch_causal_lm(grown, chunk_size=CHUNK)
    torch.testing.assert_close(grown(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               want_grown, rtol=1e-5, atol=0)


def test_patched_forward_has_no_wrapped_chain():
    """accelerate's unwrap_model(keep_fp32_wrapper=False) follows ``__wrapped__``: the
    patched forward has none (it had the class's forward, so unwrapping dropped the patch
    while is_patched stayed True and unpatching then refused), and keeps the class forward's
    signature (the Trainer reads it). Unpatching under accelerate's mixed-precision wrapper
    says what to call first."""
    import inspect
    model = patch_causal_lm(make_model("llama", seed=20))
    assert inspect.unwrap(model.forward) == model.forward
    assert inspect.signature(model.forward) == inspect.signature(make_model("llama").forward)
    patched = model.forward
    model._original_forward = patched  # what Accelerator.prepare's autocast wrapper keeps
    model.forward = lambda *a, **k: patched(*a, **k)
    with pytest.raises(RuntimeError, match=r"accelerator\.unwrap_model\(model, "
                                           r"keep_fp32_wrapper=False\) first"):
        unpatch_causal_lm(model)
    model.forward = model.__dict__.pop("_original_forward")  # what unwrap_model restores
    assert not is_patched(unpatch_causal_lm(model))


def test_unpatch_under_a_later_wrapper():
    """A hook accelerate adds after patching (model.forward wrapped, the patched forward kept
    as model._old_forward): unpatching removes the patch underneath the hook, which stays and
    runs; any other replacement of model.forward makes unpatching refuse (before, either was
    deleted or overwritten). Plain unpatching, of a deep copy too, still works."""
    ids, mask, labels = make_batch(18)
    ref = make_model("llama", seed=18)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    cls_forward = type(ref).forward

    hooked = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    hook = _AlignDevicesHook("cpu")
    _add_hook_to_module(hooked, hook)
    out = hooked(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and hook.calls == 1  # the hook runs, then the patch
    wrapper = hooked.forward
    unpatch_causal_lm(hooked)
    assert not is_patched(hooked) and hooked.forward is wrapper
    assert hooked._old_forward.__func__ is cls_forward
    out = hooked(input_ids=ids, attention_mask=mask, labels=labels)
    assert hook.calls == 2 and out.logits.shape == (B, T, V)
    torch.testing.assert_close(out.loss, want.loss, rtol=0, atol=0)
    # ... and removing the hook afterwards (accelerate's remove_hook_from_module) restores the
    # class's forward, not the patch
    hooked.forward = hooked._old_forward
    assert hooked(input_ids=ids, labels=labels).logits.shape == (B, T, V)

    replaced = patch_causal_lm(copy.deepcopy(ref))
    patched_forward = replaced.forward
    replaced.forward = lambda *a, **k: patched_forward(*a, **k)
    with pytest.raises(RuntimeError, match="forward was replaced after patch_causal_lm"):
        unpatch_causal_lm(replaced)
    assert is_patched(replaced)  # left as it was: the wrapper still reaches the patch
    assert replaced(input_ids=ids, attention_mask=mask, labels=labels).logits is None
    replaced.forward = patched_forward
    unpatch_causal_lm(replaced)
    assert "forward" not in replaced.__dict__

    plain = patch_causal_lm(copy.deepcopy(ref))
    clone = copy.deepcopy(plain)
    for m in (plain, clone):
        unpatch_causal_lm(m)
        assert not is_patched(m) and "forward" not in m.__dict__
        torch.testing.assert_close(m(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   want.loss, rtol=0, atol=0)


# ------------------------------------------------- what changes the head on the instance
def test_hooks_and_forwards_on_the_head_are_refused():
    """The fused loss reads lm_head.weight and runs the head only on an empty slice: a forward
    (pre-)hook or backward hook on the head, or a forward replaced on the head instance, would
    be bypassed silently (a hook capturing the logits got an empty tensor, a pre-hook's rescaling
    was dropped). Refused at patch time and at the call (added after patching), before the
    model's forward runs; accepted again once removed, with the reference loss."""
    ids, mask, labels = make_batch(19)
    ref = make_model("llama", seed=19)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    seen = []

    def capture(module, args, output):
        seen.append(output.shape)

    def rescale(module, args, kwargs):  # a kwargs pre-hook (with_kwargs=True)
        return (args[0] * 0.5,), kwargs

    registrations = [
        ("forward hook .*capture", lambda h: h.register_forward_hook(capture)),
        ("forward hook .*capture", lambda h: h.register_forward_hook(capture, always_call=True)),
        ("forward pre-hook .*rescale", lambda h: h.register_forward_pre_hook(rescale,
                                                                             with_kwargs=True)),
        ("backward hook", lambda h: h.register_full_backward_hook(lambda m, gi, go: None)),
        ("backward pre-hook", lambda h: h.register_full_backward_pre_hook(lambda m, go: None)),
    ]
    model = copy.deepcopy(ref)
    for what, register in registrations:
        handle = register(model.lm_head)
        with pytest.raises(RuntimeError, match=f"lm_head has hooks .{what}.*handle.remove"):
            patch_causal_lm(model)
        assert not is_patched(model)
        handle.remove()
    patch_causal_lm(model, chunk_size=CHUNK)
    for what, register in registrations:
        handle = register(model.lm_head)
        with pytest.raises(RuntimeError, match=f"lm_head has hooks .{what}.*unpatch_causal_lm"):
            model(input_ids=ids, attention_mask=mask, labels=labels)
        handle.remove()
    assert seen == []  # refused before the model's forward ran

    # a forward replaced on the instance: a user's wrapper (transformers' tensor-parallel
    # tp_forward is one too), at patch time and after patching
    wrapped = copy.deepcopy(ref)
    own = wrapped.lm_head.forward

    def halved(x):
        return own(x) * 0.5
    wrapped.lm_head.forward = halved
    replaced = r"lm_head.forward is replaced on the instance .*halved, a function"
    with pytest.raises(RuntimeError, match=replaced):
        patch_causal_lm(wrapped)
    del wrapped.lm_head.forward
    patch_causal_lm(wrapped, chunk_size=CHUNK)
    wrapped.lm_head.forward = halved
    with pytest.raises(RuntimeError, match=replaced + r".*unpatch_causal_lm"):
        wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    # the head's own forward bound on the instance changes nothing: accepted
    wrapped.lm_head.forward = own
    for m in (model, wrapped):
        torch.testing.assert_close(m(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   want, rtol=1e-5, atol=0)


def test_accelerate_device_hook_accepted_other_hooks_refused(accelerate_hooks):
    """device_map over GPUs puts AlignDevicesHook(offload=False) on lm_head: accepted (the patch
    moves the hidden states to the head's device, as the hook does), alone or chained in a
    SequentialHook, and after remove_hook_from_module. Refused: a user's ModelHook (its
    post_forward edits the logits), a subclass of AlignDevicesHook, no_grad=True, a chain with a
    foreign hook, a user's wrapper around accelerate's, and a look-alike of accelerate's
    wrapper when accelerate is not what made it."""
    acc = accelerate_hooks
    ids, mask, labels = make_batch(20)
    ref = make_model("llama", seed=20)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss

    placed = copy.deepcopy(ref)
    hook = acc.AlignDevicesHook("cpu", place_submodules=True)
    acc.add_hook_to_module(placed.lm_head, hook)
    patch_causal_lm(placed, chunk_size=CHUNK)
    out = placed(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and hook.calls == 1  # the head ran (on the empty slice) through it
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=0)
    acc.add_hook_to_module(placed.lm_head, acc.AlignDevicesHook("cpu"), append=True)
    assert type(placed.lm_head._hf_hook) is acc.SequentialHook
    torch.testing.assert_close(placed(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               want, rtol=1e-5, atol=0)

    class Halve(acc.ModelHook):
        def post_forward(self, module, output):
            return output * 0.5

    class MyAlign(acc.AlignDevicesHook):
        pass
    no_grad = acc.AlignDevicesHook("cpu")
    no_grad.no_grad = True
    for hook, name in ((Halve(), "Halve"), (MyAlign("cpu"), "MyAlign"),
                       (no_grad, r"AlignDevicesHook\(no_grad=True\)"),
                       (acc.SequentialHook(acc.AlignDevicesHook("cpu"), Halve()),
                        r"SequentialHook\(AlignDevicesHook, Halve\)")):
        refused = rf"lm_head.forward is replaced on the instance .accelerate's {name} around "
        before = copy.deepcopy(ref)
        acc.add_hook_to_module(before.lm_head, hook)
        with pytest.raises(RuntimeError, match=refused):
            patch_causal_lm(before)
        after = patch_causal_lm(copy.deepcopy(ref))
        acc.add_hook_to_module(after.lm_head, copy.deepcopy(hook))
        with pytest.raises(RuntimeError, match=refused):
            after(input_ids=ids, attention_mask=mask, labels=labels)
        # accelerate's remove_hook_from_module leaves the head's own bound forward: accepted
        acc.remove_hook_from_module(after.lm_head)
        assert "forward" in after.lm_head.__dict__
        torch.testing.assert_close(after(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   want, rtol=1e-5, atol=0)
    # a wrapper of the user's around accelerate's device hook
    outer = placed.lm_head.forward
    placed.lm_head.forward = lambda x: outer(x) * 0.5
    with pytest.raises(RuntimeError, match="replaced on the instance .*<lambda>, a function"):
        placed(input_ids=ids, attention_mask=mask, labels=labels)
    # a forward of accelerate's making only: the re-told module, not in sys.modules, is not
    # accelerate's (no look-alike passes)
    del sys.modules["accelerate.hooks"]
    lookalike = copy.deepcopy(ref)
    acc.add_hook_to_module(lookalike.lm_head, acc.AlignDevicesHook("cpu"))
    with pytest.raises(RuntimeError, match="replaced on the instance .*Linear.forward, a partial"):
        patch_causal_lm(lookalike)


def test_parametrized_head_weight():
    """A parametrized head weight (torch.nn.utils.parametrize) is computed at each read of
    lm_head.weight, which is the right tensor: weight norm trains as unpatched (gradients into
    its g and v). It is computed once per call, as in the head's own forward: spectral norm's
    training-mode power iteration steps at every read (before: three reads per call, the loss
    on a differently normalised weight and the u/v buffers three steps on)."""
    from torch.nn.utils import parametrizations, parametrize
    ids, mask, labels = make_batch(21)

    ref = make_model("llama", seed=21)
    parametrizations.weight_norm(ref.lm_head)
    fused = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    _assert_same_step(ref, fused, ids, mask, labels)

    class Counted(torch.nn.Module):
        calls = 0

        def forward(self, w):
            Counted.calls += 1
            return w

    model = make_model("llama", seed=22)
    parametrizations.spectral_norm(model.lm_head)
    parametrize.register_parametrization(model.lm_head, "weight", Counted())
    patch_causal_lm(model, chunk_size=CHUNK)  # (its checks read the weight once)
    ref = unpatch_causal_lm(copy.deepcopy(model))
    losses = []
    for m in (ref, model):
        Counted.calls = 0
        losses.append(m(input_ids=ids, attention_mask=mask, labels=labels).loss)
        losses[-1].backward()
        assert Counted.calls == 1, type(m.forward)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    norm_r, norm_f = (m.lm_head.parametrizations.weight[0] for m in (ref, model))
    torch.testing.assert_close(norm_f._u, norm_r._u, rtol=0, atol=0)
    for (name, p_r), (_, p_f) in zip(ref.named_parameters(), model.named_parameters()):
        _assert_grads_close(p_f.grad, p_r.grad, name)


def test_global_module_hooks_are_not_refused():
    """Global module hooks (register_module_forward_hook) apply to every module and are
    trackers: FlopCounterMode's ModuleTracker uses them. They are not refused, and still see
    the head called (on the empty slice)."""
    from torch.utils.flop_counter import FlopCounterMode
    ids, mask, labels = make_batch(23)
    ref = make_model("llama", seed=23)
    fused = patch_causal_lm(copy.deepcopy(ref), chunk_size=CHUNK)
    with FlopCounterMode(display=False) as flops:
        loss = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.nn.modules.module._global_forward_hooks == {}  # removed on exit
    assert f"{type(fused).__name__}.lm_head" in flops.get_flop_counts()
    torch.testing.assert_close(loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss,
                               rtol=1e-5, atol=0)


def test_torch_weight_recomputing_pre_hooks_are_accepted():
    """torch's forward pre-hooks that only set lm_head.weight from other parameters before each
    forward (pruning, the legacy spectral_norm / weight_norm) keep working: the model's forward
    calls the head (on the empty slice) before the loss reads the weight, so the loss gets this
    call's weight; the head's power iteration steps once, as unpatched. A subclass whose
    __call__ does something else is refused."""
    from torch.nn.utils import prune
    ids, mask, labels = make_batch(24)
    setups = {"pruned": lambda head: prune.l1_unstructured(head, "weight", amount=0.3),
              # a random u (seeded by make_model), one power iteration per forward in training
              "spectral norm": lambda head: torch.nn.utils.spectral_norm(head)}
    for setup in setups.values():
        def make():  # (such a module cannot be deep-copied: its weight is not a leaf)
            model = make_model("llama", seed=24)
            setup(model.lm_head)
            assert len(model.lm_head._forward_pre_hooks) == 1
            return model
        ref, fused = make(), patch_causal_lm(make(), chunk_size=CHUNK)
        _assert_same_step(ref, fused, ids, mask, labels)
        for name, b_r in ref.lm_head.named_buffers():  # the mask; spectral norm's u and v
            torch.testing.assert_close(getattr(fused.lm_head, name), b_r, rtol=0, atol=0)

    class Scaled(prune.Identity):
        def __call__(self, module, inputs):
            return (inputs[0] * 0.5,)
    fused.lm_head.register_forward_pre_hook(Scaled())
    with pytest.raises(RuntimeError, match="lm_head has hooks .forward pre-hook Scaled"):
        fused(input_ids=ids, attention_mask=mask, labels=labels)
