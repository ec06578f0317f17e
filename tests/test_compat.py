"""bmt_wrap/_compat.py: each shim over a private torch/transformers name works on the installed versions,
and no other module reaches a private name directly (a torch upgrade breaks one file)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

from bmt_wrap import _compat

PACKAGE = Path(__file__).resolve().parent.parent / "bmt_wrap"

# Private torch / transformers names as code spells them (strings and comments are not code).
_PRIVATE = re.compile(
    r"\btorch\._[A-Za-z]|\butils\._pytree\b|\bexport\._|\._version\b|_execution_engine|_make_subclass"
    r"|_register_state_dict_hook|_register_load_state_dict|\bsys\._getframe|_get_default_store|_python_dispatch"
    r"|\bdistributed_c10d\b|\._initialize_weights\b|_maybe_opt_step|_unsafe_"
    r"|\b(?:torch|transformers)(?:\.\w+)*\._[A-Za-z]\w*")  # any private module or name of theirs


def _code(path: Path) -> str:
    """The file's source with every string and comment blanked out."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        out.append(" " if tok.type in (tokenize.STRING, tokenize.COMMENT) else tok.string)
        if tok.type in (tokenize.NEWLINE, tokenize.NL):
            out.append("\n")
    return re.sub(r"\s*\.\s*", ".", " ".join(out))  # "torch . _C" as code spells it: torch._C


def test_no_module_outside_compat_uses_a_private_torch_name() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        hits = sorted(set(_PRIVATE.findall(_code(path))))
        if hits:
            offenders[str(path.relative_to(PACKAGE))] = hits
    assert not offenders, f"private names outside bmt_wrap/_compat.py: {offenders}"


def test_the_check_sees_a_private_name() -> None:
    assert _PRIVATE.search("x = t._version + torch._foreach_mul_(a, 2)")
    assert not _PRIVATE.search("x = tensor_version(t)")
    assert _PRIVATE.search("from torch.distributed.pipelining._backward import stage_backward_input")


def test_the_check_reads_code_as_the_tokenizer_spells_it(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import torch\nx = torch . _C  # torch._C in a comment\ny = 'torch._C'\n")
    assert _PRIVATE.findall(_code(source)) == ["torch._C"]


def test_version_counters() -> None:
    t = torch.zeros(3)
    v = _compat.tensor_version(t)
    t.add_(1)
    assert _compat.tensor_version(t) == v + 1
    _compat.set_version_counters([t], [v])
    assert _compat.tensor_version(t) == v


def test_autograd_callback_runs_after_backward() -> None:
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad: torch.Tensor) -> None:
        _compat.queue_autograd_callback(lambda: order.append("end"))
        order.append("hook")

    y.register_hook(hook)
    (y * x).sum().backward()
    assert order == ["hook", "end"]


def test_tensor_subclass_shares_storage() -> None:
    class Sub(torch.Tensor):
        pass

    data = torch.arange(4.0)
    sub = _compat.make_tensor_subclass(Sub, data, True)
    assert isinstance(sub, Sub) and sub.requires_grad and sub.data_ptr() == data.data_ptr()


def test_foreach_kernels() -> None:
    a, b = [torch.ones(3), torch.full((2,), 4.0)], [torch.zeros(3), torch.zeros(2)]
    _compat.foreach_mul_(a, 3.0)
    _compat.foreach_div_(a, 2.0)
    _compat.foreach_copy_(b, a)
    assert torch.equal(b[0], torch.full((3,), 1.5)) and torch.equal(b[1], torch.full((2,), 6.0))


def test_fused_adamw_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    p, g = torch.randn(8), torch.randn(8)
    ref = p.clone().requires_grad_()
    ref.grad = g.clone()
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01, foreach=False).step()
    m, v, step = torch.zeros(8), torch.zeros(8), torch.tensor(1.0)
    _compat.fused_adamw_([p], [g], [m], [v], [], [step], lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.01,
                         eps=1e-8, amsgrad=False, maximize=False)
    torch.testing.assert_close(p, ref.detach())


def test_state_dict_hooks() -> None:
    seen = []
    lin = nn.Linear(2, 2)

    def save(module, sd, prefix, local_metadata):
        sd["extra"] = torch.ones(1)

    def load_pre(module, sd, prefix, *args):
        seen.append(sd.pop("extra", None) is not None)

    _compat.register_state_dict_hooks(lin, save, load_pre)
    sd = lin.state_dict()
    assert "extra" in sd
    lin.load_state_dict(sd)
    assert seen == [True]


def test_reorder_kwargs_follows_the_exported_signature() -> None:
    class M(nn.Module):
        def forward(self, a, b):
            return a - b

    ep = torch.export.export(M(), (), {"a": torch.zeros(1), "b": torch.ones(1)})
    args = _compat.reorder_kwargs({"b": "B", "a": "A"}, ep.call_spec.in_spec)
    assert [x for x in _compat.pytree.tree_leaves(args)] == ["A", "B"]


def test_called_from_and_grad_scaler_codes() -> None:
    def check():  # like a guard: asks whether its caller runs inside one of the codes
        return _compat.called_from({test_called_from_and_grad_scaler_codes.__code__}, 4)

    def elsewhere():
        return _compat.called_from({elsewhere.__code__.replace(co_name="other")}, 4)

    assert (lambda: check())() and not elsewhere()
    codes = _compat.grad_scaler_step_codes()
    assert len(codes) == 2 and all(hasattr(c, "co_name") for c in codes)


def test_default_store_of_an_initialised_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process; the shim is covered by the CuPy tests")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = _compat.default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        dist.destroy_process_group()


def _fresh_process(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a new interpreter (modules load in the order it says); its words and stderr."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split(), out.stderr


def test_release_group_defaults_frees_a_group_torch_bound_at_import() -> None:
    # A fresh process: torch.distributed.nn must load after the group exists, as in a job.
    code = ("import weakref, torch.distributed as dist\n"
            "from bmt_wrap._compat import release_group_defaults\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "import torch.distributed.nn.functional as F\n"
            "group = weakref.ref(dist.group.WORLD)\n"
            "bound = F.all_reduce.__defaults__[-1] is group()\n"
            "dist.destroy_process_group()\n"
            "print(bound, group() is None, release_group_defaults(group()), group() is None, "
            "F.all_reduce.__defaults__[-1])\n")
    words, err = _fresh_process(code)
    assert words == ["True", "False", "[]", "True", "None"], (words, err)


def test_transformers_initialize_weights_is_replaced_and_restored() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    original = _compat.hf_initialize_weights(model)
    calls = []
    with _compat.hf_initialize_weights_replaced({model: lambda module, is_custom_code=False: calls.append(module)}):
        model.initialize_weights()
    assert calls and all(isinstance(m, nn.Module) for m in calls)
    assert _compat.hf_initialize_weights(model) == original


def test_disabled_torch_function_makes_ops_return_plain_tensors() -> None:
    class Sub(torch.Tensor):
        __torch_function__ = _compat.disabled_torch_function

    sub = _compat.make_tensor_subclass(Sub, torch.ones(2), False)
    assert type(sub * 2) is torch.Tensor and type(sub) is Sub


def test_dcp_state_dict_request_sees_get_state_dict_and_its_options() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    seen = []

    class Probe(nn.Linear):
        def state_dict(self, *args, **kwargs):
            seen.append(_compat.dcp_state_dict_request())
            return super().state_dict(*args, **kwargs)

    probe = Probe(2, 2)
    probe.state_dict()
    get_model_state_dict(probe)
    get_model_state_dict(probe, options=StateDictOptions(full_state_dict=True))
    assert seen[0] is None, "a plain state_dict() call is not DCP's"
    assert seen[1] is not None and not seen[1].full_state_dict
    assert seen[2] is not None and seen[2].full_state_dict


def test_inside_ddp_constructor_is_false_elsewhere() -> None:
    import torch.nn.parallel  # noqa: F401  (loads DistributedDataParallel, whose __init__ the shim looks for)

    # True inside DDP's constructor: tests/test_param_contract.py builds DDP around a wrapped model.
    assert not _compat.inside_ddp_constructor()


def test_register_foreach_type_puts_the_type_on_both_of_torchs_lists() -> None:
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    class Sub(torch.Tensor):
        pass

    _compat.register_foreach_type(Sub)
    _compat.register_foreach_type(Sub)
    assert optimizer._foreach_supported_types.count(Sub) == 1
    assert _foreach_utils._foreach_supported_types.count(Sub) == 1
    optimizer._foreach_supported_types.remove(Sub)
    _foreach_utils._foreach_supported_types.remove(Sub)


# ---- torch.compile shims (bmt_wrap/compiled.py adopts a block's compile) ------------------------------------
def _recording_backend(calls: list):
    def backend(gm, example_inputs):
        calls.append(len(list(gm.graph.nodes)))
        return gm.forward
    return backend


def test_compiled_inner_sees_through_torch_compile_only() -> None:
    lin = nn.Linear(2, 2)
    assert _compat.compiled_inner(lin) is None
    assert _compat.compiled_inner(torch.compile(lin, backend="eager")) is lin
    lin.compile(backend="eager")  # in place: no wrapper to see through
    assert _compat.compiled_inner(lin) is None


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compile_context_compiles_another_callable_with_the_same_options(how: str) -> None:
    torch._dynamo.reset()
    calls: list = []
    lin = nn.Linear(2, 2)
    compiled = torch.compile(lin, backend=_recording_backend(calls)) if how == "torch.compile" else lin
    if how == "module.compile":
        lin.compile(backend=_recording_backend(calls))
    assert _compat.compile_context(nn.Linear(2, 2)) is None
    ctx = _compat.compile_context(compiled)
    assert ctx is not None

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert torch.equal(ctx(double)(torch.ones(3)), torch.full((3,), 2.0))
    assert calls, "the recording backend compiled the new callable: the options were kept"


def test_compile_context_says_when_it_cannot_read_the_options() -> None:
    lin = nn.Linear(2, 2)
    lin._compiled_call_impl = lambda *a, **k: None  # compiled by something this shim does not know
    with pytest.raises(LookupError):
        _compat.compile_context(lin)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_drop_compiled_call_makes_the_call_eager_and_keeps_names(how: str) -> None:
    torch._dynamo.reset()
    calls: list = []
    lin = nn.Linear(2, 2)
    if how == "torch.compile":
        module = torch.compile(lin, backend=_recording_backend(calls))
    else:
        module = lin
        lin.compile(backend=_recording_backend(calls))
    keys = list(module.state_dict())
    _compat.drop_compiled_call(module)
    x = torch.ones(1, 2)
    torch.testing.assert_close(module(x), lin.forward(x), rtol=0, atol=0)
    assert calls == [], "nothing was compiled after the compiled call was dropped"
    assert list(module.state_dict()) == keys


def test_shutdown_frees_the_group_a_live_device_mesh_holds() -> None:
    # An HSDP script keeps its DeviceMesh to the end; the mesh's registry held the destroyed group (and
    # gloo's threads) into interpreter teardown, and shutdown() warned about "a reference outside bmt_wrap".
    code = ("import weakref, torch.distributed as dist, bmt_wrap as bmt\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "bmt.init_distributed()\n"
            "mesh = init_device_mesh('cpu', (1,), mesh_dim_names=('shard',))\n"
            "group = weakref.ref(dist.group.WORLD)\n"
            "bmt.shutdown()\n"
            "print('freed', group() is None)\n")
    words, err = _fresh_process(code)
    assert words == ["freed", "True"], (words, err)
    assert "still hold" not in err, err


def test_watch_writes_sees_every_written_tensor() -> None:
    a, b, c = torch.zeros(3), torch.ones(3), torch.zeros(3)
    bn = nn.BatchNorm1d(3)
    written: list[int] = []
    with _compat.watch_writes(lambda t: written.append(t.untyped_storage().data_ptr())):
        a.add_(1)  # marked in-place
        a.data.mul_(2)  # behind autograd: no version bump, still an op
        torch.add(b, b, out=c)  # out=
        _compat.foreach_mul_([b], 2.0)  # a list of written tensors
        bn(torch.randn(4, 3))  # running statistics, unmarked in the schema
        (a + b).sum()  # writes nothing it was given
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert written.count(ptr(a)) == 2 and ptr(c) in written and ptr(b) in written
    assert ptr(bn.running_mean) in written and ptr(bn.running_var) in written
    bn.eval()
    written.clear()
    with _compat.watch_writes(lambda t: written.append(t.untyped_storage().data_ptr())):
        bn(torch.randn(4, 3))  # evaluation reads the statistics only
    assert written == []


def test_is_fake_tells_fake_tensors_from_real_and_meta_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.empty(2)
    assert _compat.is_fake(fake) and mode is not None
    assert not _compat.is_fake(torch.empty(2)) and not _compat.is_fake(torch.empty(2, device="meta"))


def test_stage_backward_input_gives_the_inputs_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    w = nn.Parameter(torch.randn(3))
    out = x * w
    grads, param_groups = _compat.stage_backward_input([out], [torch.ones(3)], [x], iter([w]))
    assert torch.equal(grads[0], w.detach()) and w.grad is None  # the weights' gradient is left for W
    assert param_groups  # the nodes W starts from


def test_masks_as_eager_makes_transformers_mask_builders_decide_as_eager() -> None:
    import transformers.masking_utils as masking

    real = masking.is_torchdynamo_exporting
    with _compat.masks_as_eager():
        assert masking.is_torchdynamo_exporting() is False
    assert masking.is_torchdynamo_exporting is real
