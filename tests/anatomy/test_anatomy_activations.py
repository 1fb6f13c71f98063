"""Activation formulas: Korthikanti's closed forms and per-module saved-bytes rules.

Literature values are checked with their arithmetic in comments; measured
checks count the storages autograd really saves (saved_tensors_hooks,
deduplicated by storage, parameters and buffers excluded) on CPU.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memprof.anatomy.activations import (
    TensorMeta,
    cross_entropy_saved_bytes,
    module_saved_bytes,
    register_saved_rule,
    saved_bytes_rule,
    transformer_activations_total,
    transformer_layer_activations,
    transformer_layer_terms,
)
from memprof.anatomy.shapes import LayerShape, Parallelism
from memprof.errors import RegistryError, UnknownNameError

GiB = 2**30


def saved_bytes(fn, *args, exclude=()):
    """Bytes of the distinct storages autograd saves while running fn(*args)."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out


# ----------------------------------------------------------------------------- closed forms, literature


def test_eq1_small_block():
    # Korthikanti et al. 2022, Eq. 1. s=128, b=2, h=256, a=4: sbh = 65,536; 5as/h = 5*4*128/256 = 10;
    # (34 + 10) * 65,536 = 2,883,584 ("Table 3b" here and below: docs/anatomy.md#measured-saved-tensors-per-block)
    assert transformer_layer_activations(LayerShape(128, 2, 256, 4)) == 2_883_584


def test_variants_small_block():
    sbh = 128 * 2 * 256
    # no dropout: sbh(32 + 2as/h) = 65,536 * (32 + 4) = 2,359,296 (Table 3b)
    assert transformer_layer_activations(LayerShape(128, 2, 256, 4), dropout=False) == 2_359_296
    # flash: 34sbh + 4asb = 2,228,224 + 4*4*128*2 = 2,232,320 (Table 3b prints 34sbh = 2,228,224 alone)
    assert transformer_layer_activations(LayerShape(128, 2, 256, 4), attention="flash") == 34 * sbh + 4 * 4 * 128 * 2
    assert transformer_layer_activations(LayerShape(128, 2, 256, 4), attention="flash", dropout=False) == 32 * sbh + 4096
    # fp32: sbh(66 + 9as/h) = 65,536 * (66 + 18) = 5,505,024 (Table 3b)
    assert transformer_layer_activations(LayerShape(128, 2, 256, 4), bytes_per_element=4) == 5_505_024
    # SwiGLU F=688, flash, no dropout: 16sbh + 8sbF + 4asb = 1,048,576 + 1,409,024 + 4,096
    # (Table 3b: 2,457,600 + lse)
    assert (
        transformer_layer_activations(LayerShape(128, 2, 256, 4, ffn_hidden=688), attention="flash", dropout=False,
                                      mlp="swiglu")
        == 16 * sbh + 8 * 128 * 2 * 688 + 4096
    )


def test_gelu_mlp_is_18sbh_and_gqa_term():
    terms = transformer_layer_terms(LayerShape(128, 2, 256, 4), dropout=False)
    sbh = 128 * 2 * 256
    # GELU MLP = input 2sbh + 4sbF = 2sbh + 16sbh = 18sbh at F = 4h (Korthikanti et al. 2022, §4.1;
    # docs/anatomy.md#variants-memprof-uses)
    assert terms["mlp_input"] + terms["mlp_hidden"] == 18 * sbh
    # GQA g = 1/4: Q,K,V = 2sbh(1 + 2g) = 3sbh
    gqa = transformer_layer_terms(LayerShape(128, 2, 256, 4, kv_heads=1))
    assert gqa["query_key"] + gqa["value"] == 2 * sbh * (1 + Fraction(2, 4))


# Korthikanti et al. 2022, Table 3 configurations: s = 2048, t = 8
# (docs/anatomy.md#derived-memory-of-the-korthikanti-table-3-models)
MODELS = {
    "22B": dict(heads=64, hidden=6144, layers=48, batch=4, p=1),
    "175B": dict(heads=96, hidden=12288, layers=96, batch=1, p=8),
    "530B": dict(heads=128, hidden=20480, layers=105, batch=1, p=35),
    "1T": dict(heads=160, hidden=25600, layers=128, batch=1, p=64),
}


def _layer(model, tp=1, sp=False, **kw):
    m = MODELS[model]
    return transformer_layer_activations(LayerShape(2048, m["batch"], m["hidden"], m["heads"]),
                                         parallel=Parallelism(tp=tp, sequence_parallel=sp), **kw)


@pytest.mark.parametrize(
    "model,eq1,eq2,eq4,sel,full",
    [
        # GiB, 2-3 decimals, derived from Korthikanti et al. 2022 Eqs. 1, 2, 4 and Table 2
        # (docs/anatomy.md#derived-memory-of-the-korthikanti-table-3-models)
        ("22B", 6.59, 1.234, 0.824, 0.199, 0.094),
        ("175B", 2.67, 0.539, 0.334, 0.100, 0.047),
        ("530B", 3.83, 0.820, 0.479, 0.166, 0.078),
        ("1T", 4.79, 1.025, 0.598, 0.208, 0.098),
    ],
)
def test_derived_table(model, eq1, eq2, eq4, sel, full):
    # e.g. 22B: sbh = 2048*4*6144 = 50,331,648; Eq.1 = sbh(34 + 5*64*2048/6144) = sbh*140.67 = 7.08e9 B = 6.59 GiB;
    # Eq.2 = sbh(10 + 24/8 + 106.67/8) = sbh*26.33 = 1.234 GiB; Eq.4 = sbh(34 + 106.67)/8 = 0.824 GiB;
    # selective + SP = 34sbh/8 = 0.199 GiB; full = 2sbh = 0.094 GiB.
    assert round(_layer(model) / GiB, 2) == eq1
    assert round(_layer(model, tp=8) / GiB, 3) == eq2
    assert round(_layer(model, tp=8, sp=True) / GiB, 3) == eq4
    assert round(_layer(model, tp=8, sp=True, recompute="selective") / GiB, 3) == sel
    assert round(_layer(model, recompute="full") / GiB, 3) == full


@pytest.mark.parametrize("model,eq5,eq6", [("22B", 39.6, 9.6), ("175B", 32.1, 9.6), ("530B", 50.2, 17.4), ("1T", 76.6, 26.6)])
def test_eq5_eq6_totals(model, eq5, eq6):
    m = MODELS[model]
    args = (LayerShape(2048, m["batch"], m["hidden"], m["heads"]), m["layers"])
    # Eq. 5: (sbhL/t)(34 + 5as/h); 22B: 0.824 GiB * 48 = 39.6 GiB. Eq. 6: 34sbhL/t; 22B: 0.199 * 48 = 9.6 GiB.
    staged = Parallelism(tp=8, pp=m["p"], sequence_parallel=True)
    assert round(transformer_activations_total(*args, parallel=staged) / GiB, 1) == eq5
    sp = Parallelism(tp=8, sequence_parallel=True)
    assert round(transformer_activations_total(*args, recompute="selective", parallel=sp) / GiB, 1) == eq6


def test_selective_saving_gpt3_and_mtnlg():
    # GPT-3: 5as/h = 5*96*2048/12288 = 80; saving = 80/(34+80) = 70.2%. MT-NLG: 5*128*2048/20480 = 64 -> 65.3%.
    for model, five_as_h, pct in (("175B", 80, 70.2), ("530B", 64, 65.3)):
        m = MODELS[model]
        assert Fraction(5 * m["heads"] * 2048, m["hidden"]) == five_as_h
        base = _layer(model, tp=8, sp=True)
        sel = _layer(model, tp=8, sp=True, recompute="selective")
        assert round(100 * (1 - sel / base), 1) == pct


def test_table2_rows_exact():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = Fraction(s * b * h)
    r = Fraction(5 * a * s, h)  # 5as/h = 80
    shape, tp, sp = LayerShape(s, b, h, a), Parallelism(tp=t), Parallelism(tp=t, sequence_parallel=True)
    assert transformer_layer_activations(shape, parallel=tp) == sbh * (10 + Fraction(24, t) + r / t)
    assert transformer_layer_activations(shape, parallel=tp, recompute="selective") == sbh * (10 + 3)
    assert transformer_layer_activations(shape, parallel=sp) == sbh * (34 + r) / t


def test_outside_layers_and_interleave():
    s, b, h, a, L, v = 2048, 4, 6144, 64, 48, 51200
    sbh = s * b * h
    tp8 = Parallelism(tp=8)
    base = transformer_activations_total(LayerShape(s, b, h, a), L, parallel=tp8)
    # p = 1: embedding dropout mask sbh/t + final LN 2sbh/t + output input 2sbh/t + fp32 logits 4sbv/t
    with_out = transformer_activations_total(LayerShape(s, b, h, a), L, parallel=tp8, outside_layers=True, vocab_size=v)
    assert with_out - base == (sbh + 4 * sbh + 4 * s * b * v) // 8
    # the same as Korthikanti's (sbhL/t)(p/L + (4/L)(1 + v/h)) with p = 1
    assert with_out - base == round(Fraction(sbh * L, 8) * (Fraction(1, L) + Fraction(4, L) * (1 + Fraction(v, h))))
    # interleave factor 1 + (p-1)/(pm): p = 8, m = 3 -> 1 + 7/24
    staged = Parallelism(tp=8, pp=8)
    one = transformer_activations_total(LayerShape(s, 1, h, a), 96, parallel=staged)
    inter = transformer_activations_total(LayerShape(s, 1, h, a), 96, parallel=staged, interleave_stages=3)
    assert inter == round(Fraction(one) * Fraction(31, 24))


def test_530b_sbhp():
    # App. B: output-tensor deallocation saves sbhp = 2048*1*20480*35 = 1,468,006,400 elements of 2 B
    # = 2,936,012,800 B = 2.734 GiB (the paper's "2.73 GB")
    sbhp = 2048 * 1 * 20480 * 35
    assert round(2 * sbhp / GiB, 3) == 2.734
    # which is the full-recompute figure (e*sbh per layer input) times p micro-batches
    assert transformer_layer_activations(LayerShape(2048, 1, 20480, 128), recompute="full") * 35 == 2 * sbhp


def test_bad_names_raise():
    with pytest.raises(UnknownNameError):
        transformer_layer_activations(LayerShape(1, 1, 8, 2), attention="sparse")
    with pytest.raises(UnknownNameError):
        transformer_layer_activations(LayerShape(1, 1, 8, 2), recompute="some")


# ----------------------------------------------------------------------------- measured: a Megatron-like block


from blocks import Block  # noqa: E402  (shared with the reconciler tests)


S, B, H, A = 128, 2, 256, 4


def _measure_block(dtype, **kw):
    torch.manual_seed(0)
    block = Block(H, A, **kw).to(dtype)
    x = torch.randn(S, B, H, dtype=dtype, requires_grad=True)
    n, _ = saved_bytes(block, x, exclude=list(block.parameters()))
    return n


# (config kwargs, dtype, formula kwargs, Table 3b measured bytes: measured with torch 2.13 (CPU), see
# docs/anatomy.md#measured-saved-tensors-per-block)
BLOCKS = [
    (dict(), torch.bfloat16, dict(), 2_885_632),
    (dict(p=0.0), torch.bfloat16, dict(dropout=False), 2_361_344),
    (dict(attention="flash"), torch.bfloat16, dict(attention="flash"), 2_234_368),  # residual dropouts only
    (dict(p=0.0, attention="flash"), torch.bfloat16, dict(dropout=False, attention="flash"), 2_103_296),
    (dict(), torch.float32, dict(bytes_per_element=4), 5_509_120),
    (
        dict(p=0.0, attention="flash", mlp="swiglu", ffn=688),
        torch.bfloat16,
        dict(dropout=False, attention="flash", mlp="swiglu"),
        2_463_744,
    ),
]


@pytest.mark.parametrize("block_kw,dtype,formula_kw,table3b", BLOCKS, ids=["eager", "nodrop", "flash_dropout", "flash", "fp32", "swiglu"])
def test_block_matches_formula_and_table3b(block_kw, dtype, formula_kw, table3b):
    measured = _measure_block(dtype, **block_kw)
    assert measured == table3b
    ffn = block_kw.get("ffn")  # the block's MLP width is the layer shape's
    predicted = transformer_layer_activations(LayerShape(S, B, H, A, ffn_hidden=ffn), **formula_kw)
    assert abs(measured - predicted) / predicted < 0.01
    # the whole residual is the LN statistics: 2 LNs x (mean + rstd) x sb elements x itemsize (CPU: input dtype)
    item = torch.empty((), dtype=dtype).element_size()
    assert measured - predicted == 2 * 2 * S * B * item


def test_block_eager_is_sbh_34_plus_5as_over_h():
    # 2,885,632 measured = 65,536 * 44 + 2,048 LN statistics
    assert _measure_block(torch.bfloat16) == S * B * H * (34 + 5 * A * S // H) + 2048


# ----------------------------------------------------------------------------- per-module rules vs. autograd


def _module_case(module, *inputs, grad=True):
    saved, out = saved_bytes(module, *inputs, exclude=[*module.parameters(), *module.buffers()])
    metas = [TensorMeta.of(t) for t in inputs]
    out_meta = TensorMeta.of(out) if isinstance(out, torch.Tensor) else None
    return saved, module_saved_bytes(module, metas, out_meta, device="cpu", requires_input_grad=grad)


def _x(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


MODULE_CASES = [
    ("linear", lambda: (nn.Linear(32, 8), _x(4, 16, 32))),
    ("linear_bf16", lambda: (nn.Linear(32, 8).to(torch.bfloat16), _x(4, 16, 32, dtype=torch.bfloat16))),
    ("linear_no_input_grad", lambda: (nn.Linear(32, 8), _x(4, 32, grad=False))),
    ("conv1d", lambda: (nn.Conv1d(4, 6, 3), _x(2, 4, 20))),
    ("conv2d", lambda: (nn.Conv2d(8, 4, 3), _x(4, 8, 6, 6))),
    ("conv3d", lambda: (nn.Conv3d(2, 3, 3), _x(1, 2, 5, 5, 5))),
    ("layernorm", lambda: (nn.LayerNorm(32), _x(4, 16, 32))),
    ("layernorm_bf16", lambda: (nn.LayerNorm(32).to(torch.bfloat16), _x(4, 16, 32, dtype=torch.bfloat16))),
    ("layernorm_2d", lambda: (nn.LayerNorm((16, 32)), _x(4, 16, 32))),
    ("rmsnorm", lambda: (nn.RMSNorm(32), _x(4, 16, 32))),
    ("rmsnorm_bf16", lambda: (nn.RMSNorm(32).to(torch.bfloat16), _x(4, 16, 32, dtype=torch.bfloat16))),
    ("batchnorm1d", lambda: (nn.BatchNorm1d(8), _x(4, 8, 10))),
    ("batchnorm2d", lambda: (nn.BatchNorm2d(8), _x(4, 8, 6, 6))),
    ("batchnorm3d", lambda: (nn.BatchNorm3d(3), _x(2, 3, 4, 4, 4))),
    ("batchnorm2d_eval", lambda: (nn.BatchNorm2d(8).eval(), _x(4, 8, 6, 6))),
    ("groupnorm", lambda: (nn.GroupNorm(2, 8), _x(4, 8, 6, 6))),
    ("gelu", lambda: (nn.GELU(), _x(4, 32))),
    ("gelu_tanh", lambda: (nn.GELU(approximate="tanh"), _x(4, 32))),
    ("silu", lambda: (nn.SiLU(), _x(4, 32))),
    ("relu", lambda: (nn.ReLU(), _x(4, 32))),
    ("tanh", lambda: (nn.Tanh(), _x(4, 32))),
    ("sigmoid", lambda: (nn.Sigmoid(), _x(4, 32))),
    ("softmax", lambda: (nn.Softmax(dim=-1), _x(4, 32))),
    ("logsoftmax", lambda: (nn.LogSoftmax(dim=-1), _x(4, 32))),
    ("dropout", lambda: (nn.Dropout(0.1), _x(4, 16, 32))),
    ("dropout_bf16", lambda: (nn.Dropout(0.1), _x(4, 16, 32, dtype=torch.bfloat16))),
    ("dropout_eval", lambda: (nn.Dropout(0.1).eval(), _x(4, 16, 32))),
    ("embedding", lambda: (nn.Embedding(100, 16), torch.randint(0, 100, (4, 8)))),
    ("maxpool2d", lambda: (nn.MaxPool2d(2), _x(4, 8, 6, 6))),
    ("maxpool2d_stride", lambda: (nn.MaxPool2d(3, stride=2, padding=1), _x(2, 3, 9, 9))),
    ("mha", lambda: (nn.MultiheadAttention(32, 4), _x(16, 4, 32))),
    ("mha_batch_first_dropout", lambda: (nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True), _x(4, 16, 32))),
]


@pytest.mark.parametrize("name,make", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module_rule_matches_autograd(name, make):
    torch.manual_seed(0)
    module, x = make()
    grad = x.requires_grad
    args = (x, x, x) if isinstance(module, nn.MultiheadAttention) else (x,)
    measured, _ = saved_bytes(module, *args, exclude=[*module.parameters(), *module.buffers()])
    predicted = module_saved_bytes(module, [TensorMeta.of(x)], None, device="cpu", requires_input_grad=grad)
    assert predicted == measured
    if name not in ("dropout_eval",):
        assert measured > 0


def test_module_rule_spot_values():
    # Linear on x[4,128,256] fp32 saves x: 4*128*256*4 = 524,288 B (measured with torch 2.13, see
    # docs/anatomy.md#per-module-saved-tensors)
    assert module_saved_bytes(nn.Linear(256, 1024), TensorMeta((4, 128, 256), torch.float32)) == 524_288
    # LayerNorm fp32 x[4,128,256] + mean, rstd [4,128,1]: 524,288 + 2*512*4 = 528,384 (1.008x, measured)
    assert module_saved_bytes(nn.LayerNorm(256), TensorMeta((4, 128, 256), torch.float32)) == 528_384
    # Dropout on CUDA: bool mask, 1 B/element: 4*128*256 = 131,072 (0.25x fp32)
    assert module_saved_bytes(nn.Dropout(0.1), TensorMeta((4, 128, 256), torch.float32), device="cuda") == 131_072
    # Embedding: 512 int64 ids = 4,096 B (measured)
    assert module_saved_bytes(nn.Embedding(1000, 8), TensorMeta((512,), torch.int64)) == 4_096
    # A frozen Linear whose input needs grad saves only W (a parameter): 0
    frozen = nn.Linear(8, 8).requires_grad_(False)
    assert module_saved_bytes(frozen, TensorMeta((2, 8), torch.float32)) == 0


def test_cross_entropy_rule():
    logits = torch.randn(512, 1000, requires_grad=True)
    target = torch.randint(0, 1000, (512,))
    measured, _ = saved_bytes(lambda z: F.cross_entropy(z, target), logits)
    # 512*1000*4 log-softmax + 512*8 target + 4 total_weight = 2,052,100 (1.002x, measured with torch 2.13)
    assert measured == 2_052_100
    assert cross_entropy_saved_bytes(TensorMeta.of(logits), TensorMeta.of(target)) == 2_052_100
    # bf16 logits under autocast: fp32 log-softmax = 512*1000*4 + 4096 + 4 = 2.004x the bf16 logits' bytes
    bf = TensorMeta((512, 1000), torch.bfloat16)
    assert cross_entropy_saved_bytes(bf, TensorMeta.of(target), autocast=True) == 2_052_100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured_ac, _ = saved_bytes(lambda z: F.cross_entropy(z, target), logits.detach().bfloat16().requires_grad_())
    assert measured_ac == 2_052_100


def test_rule_registry():
    class MyLinear(nn.Linear):
        pass

    assert saved_bytes_rule(MyLinear(2, 2)) is saved_bytes_rule(nn.Linear)
    with pytest.raises(RegistryError):
        register_saved_rule(nn.Linear, lambda *a: 0)

    class Custom(nn.Module):
        pass

    assert saved_bytes_rule(Custom()) is None
    assert module_saved_bytes(Custom(), TensorMeta((2,), torch.float32)) is None
    register_saved_rule(Custom, lambda m, i, o, d, g: 7)
    assert module_saved_bytes(Custom(), TensorMeta((2,), torch.float32)) == 7
