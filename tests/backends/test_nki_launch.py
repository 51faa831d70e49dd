"""The "nki" backend's hardware path, on a FAKE Neuron host (tests/backends/conftest.py): what is registered with
``torch_neuronx.nki_op`` (names, mutates_args), what is launched (the right kernel, the runtime's LNC degree,
int32 lengths and slots, contiguous tensors), that ``diffusers_nki.ops`` uses the registered ops on such a host
(and that they are the nodes of a ``torch.compile`` FX graph), and that the launches give the kernels' numbers
(the recorder runs the launched kernel in the emulator). Nothing here needs, or imports, the Neuron SDK."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusers_nki import ops
from diffusers_nki.backends import nki as hw
from diffusers_nki.kernels.attention import attention_kernel
from diffusers_nki.kernels.attention_ref import attention_oracle
from diffusers_nki.kernels.cache_write import cache_write_kernel
from diffusers_nki.kernels.cache_write_ref import cache_write_ref
from diffusers_nki.kernels.qk_norm_rope import qk_norm_rope_kernel
from diffusers_nki.kernels.qk_norm_rope_ref import qk_norm_rope_ref
from diffusers_nki.prologue_ops import qk_norm_rope

_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reset():
    ops.reset_counters()


def _qkv(B=2, Sq=9, Skv=11, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g), torch.randn(B, Skv, Hkv, D, generator=g),
            torch.randn(B, Skv, Hkv, D, generator=g))


def _tensor_args(launch):
    return [a for a in launch.args if a[0] == "tensor"]


# ----------------------------------------------------------------------------------------------------------
# no SDK: the package imports and runs without it, and says why "nki" is unavailable
# ----------------------------------------------------------------------------------------------------------
def test_package_never_imports_the_sdk():
    code = ("import sys, torch, diffusers_nki\n"
            "from diffusers_nki import ops, prologue_ops\n"
            "from diffusers_nki.backends import nki\n"
            "q = torch.randn(1, 5, 2, 8)\n"
            "ops.attention(q, q, q, backend='auto')\n"
            "assert nki.unavailable_reason() and nki.hardware_ops() == {}\n"
            "bad = [m for m in ('torch_neuronx', 'nki', 'neuronxcc') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_unavailable_nki_backend_raises_naming_why():
    reason = hw.unavailable_reason()
    assert reason
    kc = torch.zeros(1, 8, 2, 8)
    with pytest.raises(RuntimeError, match="backend 'nki' is unavailable"):
        ops.cache_write(kc, kc.clone(), kc[:, :2], kc[:, :2], torch.tensor([0]), backend="nki")
    with pytest.raises(RuntimeError, match="backend 'nki' is unavailable"):
        hw.kernel("attention")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_force_emulator_accepts_truthy_spellings(monkeypatch, fake_neuron, value):
    from diffusers_nki import nki as shim

    fake_neuron()
    monkeypatch.setenv("DIFFUSERS_NKI_FORCE_EMULATOR", value)
    assert hw.force_emulator()
    assert "DIFFUSERS_NKI_FORCE_EMULATOR" in hw.unavailable_reason()
    assert shim._load_real() is None  # the shim keeps the emulator too


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_force_emulator_falsy_spellings(monkeypatch, fake_neuron, value):
    from diffusers_nki import nki as shim

    fake = fake_neuron()
    monkeypatch.setenv("DIFFUSERS_NKI_FORCE_EMULATOR", value)
    assert not hw.force_emulator()
    assert hw.unavailable_reason() is None
    assert shim._load_real()[0] is fake.nki  # a real-looking nki package is detected


# ----------------------------------------------------------------------------------------------------------
# LNC: the runtime's degree
# ----------------------------------------------------------------------------------------------------------
def _set_env(monkeypatch, platform, lnc, cc_flags):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", platform)
    for name, value in (("NEURON_LOGICAL_NC_CONFIG", lnc), ("NEURON_CC_FLAGS", cc_flags)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.mark.parametrize("platform,env,cc,want", [
    ("trn2", None, None, 2), ("trn3", None, None, 2), ("trn1", None, None, 1), ("inf2", None, None, 1),
    ("trn2", "1", None, 1), ("trn2", "2", None, 2), ("trn3", "1", "--lnc=1", 1),
    ("trn2", None, "-O1 --logical-nc-config 2", 2),
])
def test_runtime_lnc(monkeypatch, platform, env, cc, want):
    _set_env(monkeypatch, platform, env, cc)
    assert hw.runtime_lnc() == want


@pytest.mark.parametrize("product,want", [("trn1.32xlarge", ("trn1", 1)), ("trn2.48xlarge", ("trn2", 2)),
                                          ("trn3.48xlarge", ("trn3", 2)), ("inf2.xlarge", ("trn1", 1)),
                                          ("", ("trn2", 2))])
def test_platform_from_the_instance_type(monkeypatch, product, want):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    monkeypatch.setattr(hw, "_instance_type", lambda: product)
    assert (hw.platform_target(), hw.runtime_lnc()) == want


@pytest.mark.parametrize("platform,env,cc,msg", [
    ("trn2", "3", None, "NEURON_LOGICAL_NC_CONFIG='3': the LNC degree must be 1 or 2"),
    ("trn1", "2", None, "LNC 2 does not exist on trn1"),
    ("trn2", "2", "--lnc=1", "NEURON_CC_FLAGS compiles for LNC 1 but the runtime uses LNC 2"),
    ("trn2", None, "--lnc 1", "NEURON_CC_FLAGS compiles for LNC 1 but the runtime uses LNC 2"),
    ("trn9", None, None, "NEURON_PLATFORM_TARGET_OVERRIDE='trn9' is not one of"),
])
def test_runtime_lnc_mismatch_is_a_clear_error(monkeypatch, platform, env, cc, msg):
    _set_env(monkeypatch, platform, env, cc)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        hw.runtime_lnc()


# ----------------------------------------------------------------------------------------------------------
# TorchNeuron: nki_op registration and the launches behind it
# ----------------------------------------------------------------------------------------------------------
def test_nki_op_registration(fake_neuron):
    from diffusers_nki import backends

    fake = fake_neuron()
    backends.require("nki")  # patch() resolves the backend this way: it registers the ops eagerly
    assert len(fake.nki_op_calls) == 4
    regs = hw.hardware_ops()
    assert set(regs) == {"attention", "cache_write", "qk_norm_rope", "attention_lse"}
    assert fake.nki_op_calls == [("diffusers_nki::attention_nki", ()),
                                 ("diffusers_nki::cache_write_nki", ("k_cache", "v_cache")),
                                 ("diffusers_nki::qk_norm_rope_nki", ()),
                                 ("diffusers_nki::attention_lse_nki", ())]
    assert hw.hardware_ops() is regs and len(fake.nki_op_calls) == 4  # registered once
    schema = str(torch.ops.diffusers_nki.cache_write_nki.default._schema)
    assert re.search(r"Tensor\(a\d*!\) k_cache, Tensor\(a\d*!\) v_cache, Tensor k, Tensor v, Tensor slot\) -> \(\)$",
                     schema), schema
    assert str(torch.ops.diffusers_nki.attention_nki.default._schema).endswith("-> Tensor")


def test_attention_launch_contract(fake_neuron, monkeypatch):
    fake = fake_neuron()
    used_custom_op = []
    monkeypatch.setattr(ops, "_attention_op", lambda *a: used_custom_op.append(a))
    q, k, v = _qkv()
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a strided BSHD view, as processors pass
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(2, 8, 2, 8, generator=g), torch.randn(2, 8, 2, 8, generator=g)
    cl, kvl = torch.tensor([5]), torch.tensor([11, 4])  # int64, as users pass them
    out = ops.attention(q, k, v, kc, vc, cl, kvl, scale=0.3, causal_block=3, backend="nki")
    assert not used_custom_op, "on a TorchNeuron host the nki_op-registered op is used, not the custom op"
    ref = attention_oracle(q, k, v, kc, vc, cl, kvl, 0.3, 3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    (launch,) = fake.launches
    assert launch.kernel == "attention" and launch.target is attention_kernel
    assert launch.lnc == 2  # trn2, NEURON_LOGICAL_NC_CONFIG unset: the compiler's default degree
    tensors = _tensor_args(launch)
    assert all(t[3] for t in tensors), "every tensor input is contiguous"
    assert [t[1] for t in tensors[5:7]] == [torch.int32, torch.int32] and [t[2] for t in tensors[5:7]] == [(1,), (2,)]
    assert launch.args[7] == ("value", 0.3) and launch.args[8] == ("value", 3)
    assert ops.counters()["attention"]["nki"] == 1


def test_attention_runtime_lnc1(fake_neuron, monkeypatch):
    fake = fake_neuron()
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    q, k, v = _qkv(B=1)
    out = ops.attention(q, k, v, backend="nki")
    torch.testing.assert_close(out.double(), attention_oracle(q, k, v), rtol=1e-5, atol=1e-5)
    assert [x.lnc for x in fake.launches] == [1]


_READS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")


class _HostReads:
    """Counts reads of tensor values on the host (``int(t)``, ``float(t)``, ``bool(t)``, ``t.__index__()``,
    ``t.item()``, ``t.tolist()``: on a device each is a sync, under XLA a graph break) by wrapping those methods of
    ``torch.Tensor`` for the block (a torch-function mode would not see inside custom-op bodies), except the reads
    the fake device makes while a kernel runs "on the device" (the emulator reading its inputs is the device's
    work). ``only`` (paths) keeps the reads whose calling frame is in one of them."""

    def __init__(self, fake=None, only=()):
        self.fake, self.only, self.reads, self._saved = fake, tuple(only), [], {}

    def _site(self):
        f = sys._getframe(2)
        while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == __file__):
            f = f.f_back
        return ("?", 0) if f is None else (f.f_code.co_filename, f.f_lineno)

    def __enter__(self):
        for name in _READS:
            orig = self._saved[name] = getattr(torch.Tensor, name)

            def wrapped(t, *a, _name=name, _orig=orig, **k):
                if not (self.fake and self.fake.on_device):
                    path, line = self._site()
                    if not self.only or any(str(o) in path for o in self.only):
                        self.reads.append(f"{path}:{line} {_name}" if self.only else _name)
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return False


def test_host_read_counter_fires():
    """The counter is proven first: each way of reading a value is counted, inside a custom op's body too."""
    t = torch.tensor([3, 4])

    @torch.library.custom_op("diffusers_nki_test::reads_inside", mutates_args=())
    def reads_inside(x: torch.Tensor) -> torch.Tensor:
        int(x[0])
        return x.clone()

    with _HostReads() as m:
        int(t[0]), float(t[0]), bool(t[0] > 1), t[1].item(), t.tolist(), int(t.min())
        reads_inside(t)
    assert m.reads == ["__int__", "__float__", "__bool__", "item", "tolist", "__int__", "__int__"]


def test_nki_path_reads_no_runtime_value_on_the_host(fake_neuron):
    """cache_len, kv_len and slot are never read on the host on the "nki" path (the host-side plan built them);
    before the fix ops.attention read kv_len (min/max) and the twin's check read cache_len and slot per call."""
    fake = fake_neuron()
    q, k, v = _qkv()
    kc, vc = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
    cl, kvl, slot = torch.tensor([4]), torch.tensor([11, 4]), torch.tensor([4])
    with _HostReads(fake) as m:
        ops.cache_write(kc, vc, k, v, slot, backend="nki")
        out = ops.attention(q, k, v, kc, vc, cl, kvl, backend="nki")
    assert m.reads == [], f"host reads of runtime values on the nki path: {m.reads}"
    ref = attention_oracle(q, k, v, kc, vc, cl, kvl)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cache_len must be an integer tensor with one element"):
        ops.attention(q, k, v, kc, vc, torch.tensor([4, 4]), backend="nki")  # shapes are still checked
    with pytest.raises(ValueError, match="cache_len=30 is outside"):  # host memory, torch twin: values checked
        ops.attention(q, k, v, kc, vc, torch.tensor([30]), backend="torch")


def test_kernel_objects_are_called_as_jitted_never_rejitted(fake_neuron, monkeypatch):
    """The module's @nki.jit object is the kernel (no ``__wrapped__`` guess, no second nki.jit); with
    NEURON_LOGICAL_NC_CONFIG set it is called plainly (the env sets the degree), unset with the bracket."""
    fake = fake_neuron()
    q, k, v = _qkv(B=1)
    ops.attention(q, k, v, backend="nki")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    ops.attention(q, k, v, backend="nki")
    assert hw.kernel("attention").target is attention_kernel
    assert fake.jit_calls == [], "the backend re-jitted a kernel object"
    assert [(x.lnc, x.bracket) for x in fake.launches] == [(2, True), (2, False)]


@pytest.mark.parametrize("slot", [[4], [1, 5]], ids=["shared_slot", "per_batch_slot"])
@pytest.mark.parametrize("layout", ["contiguous", "strided_views"])
def test_cache_write_launch_contract_and_rebind(fake_neuron, slot, layout):
    fake = fake_neuron()
    _, k, v = _qkv(Skv=3)
    if layout == "strided_views":  # AnyFlow-FAR's layout: the op writes BSHD views of a [2, B, H, C, D] buffer
        base = torch.zeros(2, 2, 2, 8, 8)
        kc, vc = base[0].transpose(1, 2), base[1].transpose(1, 2)
    else:
        kc, vc = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    ptrs = (kc.data_ptr(), vc.data_ptr())
    kr, vr = kc.clone(), vc.clone()
    s = torch.tensor(slot)  # int64
    cache_write_ref(kr, vr, k, v, s)
    ops.cache_write(kc, vc, k, v, s, backend="nki")
    assert torch.equal(kc, kr) and torch.equal(vc, vr), "the caller's caches hold the write (rebound)"
    assert (kc.data_ptr(), vc.data_ptr()) == ptrs  # in place: the caller's tensors, never new ones
    (launch,) = fake.launches
    assert launch.kernel == "cache_write" and launch.target is cache_write_kernel and launch.lnc == 2
    tensors = _tensor_args(launch)
    assert all(t[3] for t in tensors)
    assert tensors[4][1] == torch.int32 and tensors[4][2] == (len(slot),)
    assert ops.counters()["cache_write"]["nki"] == 1


def test_rebind_copies_only_when_needed():
    from diffusers_nki.backends._launch import rebind

    dst = torch.zeros(2, 3)
    rebind(dst, dst)  # the kernel returned the caller's buffer: nothing to do
    alias = dst.view(2, 3)
    alias.fill_(1.0)
    rebind(dst, alias)
    assert torch.equal(dst, torch.ones(2, 3))
    view = torch.zeros(3, 2).t()  # a strided destination gets the values copied in
    rebind(view, torch.full((2, 3), 7.0))
    assert torch.equal(view, torch.full((2, 3), 7.0))
    with pytest.raises(RuntimeError, match="does not match the tensor it updates"):
        rebind(dst, torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match="returned no result"):
        rebind(dst, None)


def test_qk_norm_rope_launch_contract(fake_neuron):
    fake = fake_neuron()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 3 * 8, generator=g)
    x_view = x.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    w = torch.randn(24, generator=g)
    cos, sin = torch.randn(1, 7, 1, 8, generator=g), torch.randn(1, 7, 1, 8, generator=g)
    out = qk_norm_rope(x_view, w, 1e-6, cos, sin, 3, backend="nki")
    ref = qk_norm_rope_ref(x, w, 1e-6, cos, sin, 3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (launch,) = fake.launches
    assert launch.kernel == "qk_norm_rope" and launch.target is qk_norm_rope_kernel and launch.lnc == 2
    assert all(t[3] for t in _tensor_args(launch))
    assert launch.args[2] == ("value", 1e-6) and launch.args[5] == ("value", 3)
    assert ops.counters()["qk_norm_rope"]["nki"] == 1


def test_fused_block_chain_launch_contract(fake_neuron):
    """modulate_ops on the "nki" backend: the ln_modulate kernels launched (contiguous inputs, the runtime LNC), the
    twins' results, counted in modulate_ops' table."""
    from diffusers_nki import modulate_ops
    from diffusers_nki.kernels.ln_modulate import gated_residual_kernel
    from diffusers_nki.kernels.ln_modulate_ref import gated_residual_ref

    fake = fake_neuron()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, 16, generator=g)
    y = torch.randn(2, 9, 16, generator=g).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    gate, scale, shift = (torch.randn(2, 6, 16, generator=g).chunk(6, dim=1)[i] for i in range(3))  # strided views
    before = modulate_ops.counters()["gated_residual_ln"]["nki"]
    r, n = modulate_ops.gated_residual_ln(x, y, gate, None, None, scale, shift, 1e-6, backend="nki")
    r_t, n_t = gated_residual_ref(x, y, gate, None, None, scale, shift, 1e-6, True)
    assert torch.equal(r, r_t)
    torch.testing.assert_close(n, n_t, rtol=1e-5, atol=1e-5)
    (launch,) = fake.launches
    assert launch.kernel == "gated_residual" and launch.target is gated_residual_kernel and launch.lnc == 2
    assert all(t[3] for t in _tensor_args(launch))
    assert modulate_ops.counters()["gated_residual_ln"]["nki"] == before + 1


def test_vae_norm_silu_launch_contract(fake_neuron):
    """modulate_ops.rms_norm_silu on the "nki" backend: the rms_norm_silu kernel launched on the [B, G, C, M] view
    (contiguous tensors, scale and silu as values, the runtime LNC), the twin's result in the caller's layout,
    counted in modulate_ops' table."""
    from diffusers_nki import modulate_ops
    from diffusers_nki.kernels.rms_norm_silu import rms_norm_silu_kernel

    fake = fake_neuron()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 3, 12, 4, 5, generator=g).permute(0, 2, 1, 3, 4)  # the upsamplers' [B, T, C, H, W] storage
    gamma = torch.rand(12, generator=g) + 0.5
    before = modulate_ops.counters()["rms_norm_silu"]["nki"]
    out = modulate_ops.rms_norm_silu(x, gamma, None, 12 ** 0.5, True, backend="nki")
    ref = torch.nn.functional.silu(torch.nn.functional.normalize(x, dim=1) * 12 ** 0.5 * gamma.view(12, 1, 1, 1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.stride() == x.stride()
    (launch,) = fake.launches
    assert launch.kernel == "rms_norm_silu" and launch.target is rms_norm_silu_kernel and launch.lnc == 2
    assert all(t[3] for t in _tensor_args(launch))
    assert launch.args[3] == ("value", 12 ** 0.5) and launch.args[4] == ("value", True)
    assert modulate_ops.counters()["rms_norm_silu"]["nki"] == before + 1


def test_xla_path_is_refused_naming_torchneuron(fake_neuron):
    """A torch-neuronx without ``nki_op`` (the XLA-device integration, torch-neuronx 2.9): one clear error naming
    TorchNeuron, for an explicit backend="nki" and for the op; nothing is launched."""
    from diffusers_nki import backends

    fake = fake_neuron(nki_op=False)
    reason = hw.unavailable_reason()
    assert "TorchNeuron" in reason and "nki_op" in reason and "2.9.0" in reason
    assert hw.hardware_ops() == {}
    with pytest.raises(RuntimeError, match="TorchNeuron"):
        backends.require("nki")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="TorchNeuron"):
        ops.attention(q, k, v, backend="nki")
    assert fake.launches == []


@pytest.mark.parametrize("slot", [[4], [1, 5]], ids=["shared_slot", "per_batch_slot"])
@pytest.mark.parametrize("layout", ["contiguous", "strided_views"])
def test_fresh_output_buffers_keep_every_untouched_slot(fake_neuron, slot, layout):
    """A framework that returns FRESH buffers for the caches (only the kernel's DMA-written rows defined, the rest
    NaN) instead of aliases: the caller's caches get exactly the chunk's rows; every other slot keeps its value."""
    fake_neuron(fresh_outputs=True)
    _, k, v = _qkv(Skv=3)
    g = torch.Generator().manual_seed(7)
    if layout == "strided_views":
        base = torch.randn(2, 2, 2, 8, 8, generator=g)
        kc, vc = base[0].transpose(1, 2), base[1].transpose(1, 2)
    else:
        kc, vc = torch.randn(2, 8, 2, 8, generator=g), torch.randn(2, 8, 2, 8, generator=g)
    kr, vr = kc.clone(), vc.clone()
    s = torch.tensor(slot)
    cache_write_ref(kr, vr, k, v, s)
    ops.cache_write(kc, vc, k, v, s, backend="nki")
    assert not torch.isnan(kc).any() and not torch.isnan(vc).any(), "garbage rows of the fresh buffer leaked in"
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def _aot_capture(graphs):
    from torch._dynamo.backends.common import aot_autograd

    def fw(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return aot_autograd(fw_compiler=fw)


def test_nki_op_bodies_trace_under_fake_and_functional_modes(fake_neuron):
    """torch.compile through AOT autograd: dynamo traces with FakeTensorMode, AOT functionalizes under
    FunctionalTensorMode (which runs each op's fake implementation, the nki_op body, on the unwrapped fake tensors);
    the bodies call the kernel objects, which TRACE the kernels at the fake shapes (no short-circuit). The in-place cache write becomes a functionalized node; the compiled step
    gives the eager numbers."""
    fake = fake_neuron()
    from diffusers_nki import backends

    backends.require("nki")
    graphs = []

    def step(q, k, v, kc, vc, slot, cache_len):
        ops.cache_write(kc, vc, k, v, slot, backend="nki")
        return ops.attention(q, k, v, kc, vc, cache_len, backend="nki")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True, backend=_aot_capture(graphs))
        q, k, v = _qkv()
        kc, vc = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        args = (torch.tensor([4], dtype=torch.int32), torch.tensor([7], dtype=torch.int32))
        out = compiled(q, k, v, kc, vc, *args)
        kc2, vc2 = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        ref = step(q, k, v, kc2, vc2, *args)
        assert torch.equal(out, ref) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
        traced = [x.kernel for x in fake.launches if x.traced]
        # each kernel traced by dynamo (FakeTensorMode) and again by AOT's functionalization (FunctionalTensorMode
        # re-invokes the op's fake implementation, the nki_op body, on the unwrapped fake tensors)
        assert traced.count("attention") >= 2 and traced.count("cache_write") >= 2, traced
        assert fake.trace_modes and all(fm for fm, _ in fake.trace_modes), "a trace ran outside FakeTensorMode"
        text = "\n".join(str(gm.graph) for gm in graphs)
        assert "auto_functionalized" in text and "cache_write_nki" in text and "attention_nki" in text, text
    finally:
        torch._dynamo.reset()


def test_kernel_trace_fails_like_the_kernel(fake_neuron):
    """The trace is the kernel's own: a shape the kernel asserts against fails under fake tracing too."""
    fake_neuron()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 5, 2, 256)  # head_dim 256 > the kernel's limit
        with pytest.raises(Exception):
            hw.launch("attention", q, q, q, None, None, None, None, None, 0)


def test_compiled_graph_holds_the_nki_ops(fake_neuron):
    """Under torch.compile the kernel ops registered with nki_op are the graph's nodes (TorchNeuron lowers them
    to the kernel), not our Python custom ops; the compiled step gives the eager result."""
    fake_neuron()
    from diffusers_nki import backends

    backends.require("nki")  # what patch() does: the nki_op ops are registered before anything is traced
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q, k, v, kc, vc, slot, cache_len):
        ops.cache_write(kc, vc, k, v, slot, backend="nki")
        return ops.attention(q, k, v, kc, vc, cache_len, backend="nki")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True, backend=capture)
        q, k, v = _qkv()
        kc, vc = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        args = (torch.tensor([4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32))
        out = compiled(q, k, v, kc, vc, *args)
        kc2, vc2 = torch.zeros(2, 20, 2, 8), torch.zeros(2, 20, 2, 8)
        ref = step(q, k, v, kc2, vc2, *args)
        assert torch.equal(out, ref) and torch.equal(kc, kc2)
        targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
        assert any("diffusers_nki.attention_nki" in t for t in targets), targets
        assert any("diffusers_nki.cache_write_nki" in t for t in targets), targets
        assert not any(t.startswith("diffusers_nki.attention.") for t in targets), targets
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------------
# a Neuron host without an importable SDK: backend="auto" says what to install, once
# ----------------------------------------------------------------------------------------------------------
def test_auto_on_a_neuron_host_without_the_sdk_warns_once(monkeypatch):
    import warnings

    from diffusers_nki import backends

    monkeypatch.delenv("DIFFUSERS_NKI_FORCE_EMULATOR", raising=False)
    monkeypatch.setattr(hw, "_has_device", lambda: True)  # /dev/neuron* present; the SDK is not installed here
    monkeypatch.setattr(backends, "_auto_choice", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.resolve("auto") == "torch" and backends.resolve("auto") == "torch"
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "Neuron devices" in msgs[0] and "torch-neuronx>=2.13" in msgs[0] and "nki>=0.7" in msgs[0]
    assert hw.unavailable_reason() in msgs[0]


def test_auto_without_neuron_devices_does_not_warn(monkeypatch):
    import warnings

    from diffusers_nki import backends

    monkeypatch.setattr(hw, "_has_device", lambda: False)
    monkeypatch.setattr(backends, "_auto_choice", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.resolve("auto") == "torch"
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert hw.install_hint() is None


def test_cached_causal_wan_rollout_reads_no_runtime_value_on_the_host(fake_neuron):
    """A whole cached rollout of the tiny causal Wan pipeline on the "nki" path: every length and slot comes from the
    host-side plan; the project's code reads no tensor value on the host (the pipeline ran the nki kernels)."""
    import diffusers_nki
    from diffusers_nki.testing import tiny

    fake = fake_neuron()
    pipe = tiny.tiny_pipeline("causal_wan")
    diffusers_nki.patch(pipe, backend="nki")
    with torch.no_grad(), _HostReads(fake, only=(_REPO / "diffusers_nki", _REPO / "kernels")) as m:
        pipe(**tiny.tiny_call_kwargs("causal_wan", chunks=2, steps=1))
    c = ops.counters()
    assert c["attention"]["nki"] > 0 and c["cache_write"]["nki"] > 0, c
    assert m.reads == [], m.reads
