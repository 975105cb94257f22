"""`LlamaModel.forward` and `Qwen2Model.forward` for decode-sized batches on our CPU platform: the
ops SGLang's layers run there (our native per-token ops, the few-row product, our attention
backend), called one after another instead of through SGLang's per-layer machinery.

At decode sizes on two cores a layer's dozen ops are each a short native call, but SGLang's
machinery around them (module calls, stage boundaries and the residual stream, fused-op dispatch,
the linear hooks) costs more than the ops (`benchmark/profile_round.py`; figures in
`benchmark/results/HISTORY.md`, block 1). This forward runs the same
kernels with the same inputs, so its logits are bit-identical to SGLang's forward's
(`test/test_decode_forward.py` compares them). It runs only where every layer is one SGLang would
run as described: one rank, plain Llama layers (`LlamaDecoderLayer`: SmolLM2, Llama 3, Mistral) or
Qwen2 layers (`Qwen2DecoderLayer`: the same ops, with biases on q, k and v), unquantised and
without LoRA, no captured hidden states, no torch forward hooks but the SnapKV observer's
(prefill only; the plan is made at a model's first decode-sized forward), a decode or
target-verify batch of at most `MAX_WEIGHT_MAJOR_ROWS` tokens on our attention backend. Anything
else runs SGLang's forward.

The plan reads some fifteen private attributes of SGLang's layers. Where one of them is gone (a
rename in SGLang), the model runs SGLang's forward, with one logged warning per process naming
what was missing; with `SGLANG_MAGICDEC_STRICT=1` (the tests set it) the error is raised instead.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch

from magicdec_kernels import cpu_native
from sglang_magicdec.platforms import torch_ops

logger = logging.getLogger(__name__)

# Set to "1" to raise, instead of warning and running SGLang's forward, where a plan cannot be made.
STRICT_ENV = "SGLANG_MAGICDEC_STRICT"


@dataclass(frozen=True)
class LayerPlan:
    """One layer's modules, as its forward reads them."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    qkv: torch.nn.Module
    o_proj: torch.nn.Module
    gate_up: torch.nn.Module
    down: torch.nn.Module
    rotary: torch.nn.Module
    act_fn: torch.nn.Module
    attn: torch.nn.Module
    q_size: int
    kv_size: int


@dataclass(frozen=True)
class ModelPlan:
    layers: list[LayerPlan]
    final_norm: torch.nn.Module


# Each model's plan (None: not one this forward runs), made at its first decode-sized forward.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Whether this process has logged that a plan could not be made (once per process).
_warned_unplannable = False


def model_forward(
    original, model, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None
):
    """An AROUND hook of `LlamaModel.forward` and `Qwen2Model.forward` (`hooks.register`)."""
    mode = forward_batch.forward_mode
    if (
        input_embeds is None
        and pp_proxy_tensors is None
        and (mode.is_decode() or mode.is_target_verify())
        and 0 < input_ids.shape[0] <= torch_ops.MAX_WEIGHT_MAJOR_ROWS
        and _is_ours(forward_batch)
    ):
        plan = _PLANS.get(model, False)
        if plan is False:
            plan = _PLANS[model] = plan_of(model)
        if plan is not None:
            return run(plan, model, input_ids, positions, forward_batch)
    return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)


def _is_ours(forward_batch) -> bool:
    from sglang_magicdec.attention import IndexAttnBackend

    return isinstance(_attn_backend(), IndexAttnBackend)


def _attn_backend():
    from sglang.srt.model_executor.forward_context import get_attn_backend

    return get_attn_backend()


def run(plan: ModelPlan, model, input_ids, positions, forward_batch) -> torch.Tensor:
    """The model's forward, layer after layer: what SGLang's layers compute, in their order."""
    backend = _attn_backend()
    hidden = model.embed_tokens(input_ids)
    residual = None
    for layer in plan.layers:
        x, residual = _norm(layer.input_norm, hidden, residual)
        qkv = _linear(layer.qkv, x)
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q, k = _rotary(layer.rotary, positions, q, k)
        attn = layer.attn
        k = k.view(-1, attn.tp_k_head_num, attn.qk_head_dim)
        v = v.view(-1, attn.tp_v_head_num, attn.v_head_dim)
        hidden = _linear(layer.o_proj, backend.forward(q, k, v, attn, forward_batch))
        x, residual = _norm(layer.post_norm, hidden, residual)
        hidden = _linear(layer.down, _silu_and_mul(layer.act_fn, _linear(layer.gate_up, x)))
    return _norm(plan.final_norm, hidden, residual)[0]


def _norm(norm, x, residual):
    result = cpu_native.rms_norm(
        x, residual, norm.weight.data, norm.variance_epsilon, norm.cast_x_before_out_mul
    )
    if result is None:
        result = norm(x) if residual is None else norm(x, residual)
        if residual is None:
            return result, x
        return result
    out, residual_out = result
    return out, x if residual is None else residual_out


def _linear(module, x):
    product = torch_ops.few_rows_product(x, module.weight)
    if product is None:
        return module.quant_method.apply(module, x, module.bias)
    return product if module.bias is None else product + module.bias


def _rotary(rotary, positions, q, k):
    if cpu_native.rotary_embedding(
        positions, q, k, rotary.cos_sin_cache, rotary.head_size, rotary.is_neox_style
    ):
        return q, k
    return rotary(positions, q, k)


def _silu_and_mul(act_fn, x):
    out = cpu_native.silu_and_mul(x)
    return act_fn(x) if out is None else out


def plan_of(model) -> ModelPlan | None:
    """The plan of a model this forward runs as SGLang would, else None: also where the plan
    cannot be made, because SGLang no longer has what it reads (one warning per process), or
    raises that error when `SGLANG_MAGICDEC_STRICT=1`."""
    global _warned_unplannable
    try:
        return _plan(model)
    except Exception as error:  # AttributeError, ImportError, TypeError...: SGLang changed
        if os.environ.get(STRICT_ENV) == "1":
            raise
        if not _warned_unplannable:
            _warned_unplannable = True
            logger.warning(
                "decode forward: cannot plan %s (%s: %s), running SGLang's forward instead; "
                "has SGLang changed what decode_forward.plan_of reads?",
                type(model).__name__,
                type(error).__name__,
                error,
            )
        return None


def _plan(model) -> ModelPlan | None:
    from sglang.kernels.fused_op import get_fused_op_backend
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
    from sglang.srt.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2MLP

    # The layer classes whose forward is the ops `run` calls, with their attention and MLP.
    plain_layers = {
        LlamaDecoderLayer: (LlamaAttention, LlamaMLP),
        Qwen2DecoderLayer: (Qwen2Attention, Qwen2MLP),
    }

    def plain_norm(norm) -> bool:
        return (
            type(norm) is RMSNorm
            and norm.variance_size_override is None
            and norm.override_orig_dtype is None
            and not norm.fp32_residual
            and _dispatches_to(norm, torch_ops.rms_norm_forward)
        )

    def plain_linear(linear) -> bool:
        return (
            type(linear.quant_method) is UnquantizedLinearMethod
            and not hasattr(linear, "set_lora")
            and not hasattr(linear, "base_layer")
            and getattr(linear, "tp_size", 1) == 1
        )

    if get_fused_op_backend() is not None:
        # A forced fused-op backend (SGLANG_FORCE_FUSED_OP_BACKEND, `set_fused_op_backend`)
        # takes precedence over `_forward_method` in `BaseFusedOp.forward`: not our ops.
        return None
    layers = list(model.layers)
    if (
        _hooked(model)
        or model.pp_group.world_size != 1
        or model.layers_to_capture
        or model.start_layer != 0
        or model.end_layer != len(layers)
        or not plain_norm(model.norm)
    ):
        return None
    rotary_classes = tuple(torch_ops.rotary_classes())
    plans = []
    for layer in layers:
        attention, mlp = layer.self_attn, getattr(layer, "mlp", None)
        if not (
            (type(attention), type(mlp)) == plain_layers.get(type(layer))
            and attention.num_heads == attention.total_num_heads  # one rank
            and all(
                plain_linear(m)
                for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            )
            and plain_norm(layer.input_layernorm)
            and plain_norm(layer.post_attention_layernorm)
            and type(attention.rotary_emb) in rotary_classes
            and _dispatches_to(attention.rotary_emb, torch_ops.rotary_forward)
            and not hasattr(attention.rotary_emb, "sin_cos_cache")
            and attention.rotary_emb.cos_sin_cache.shape[-1] == attention.rotary_emb.rotary_dim
            and type(mlp.act_fn) is SiluAndMul
            and _dispatches_to(mlp.act_fn, torch_ops.silu_and_mul_forward)
            and mlp.dual_gemm.mode is None
            and not mlp.activation_quant.enabled
        ):
            return None
        plans.append(
            LayerPlan(
                input_norm=layer.input_layernorm,
                post_norm=layer.post_attention_layernorm,
                qkv=attention.qkv_proj,
                o_proj=attention.o_proj,
                gate_up=mlp.gate_up_proj,
                down=mlp.down_proj,
                rotary=attention.rotary_emb,
                act_fn=mlp.act_fn,
                attn=attention.attn,
                q_size=attention.q_size,
                kv_size=attention.kv_size,
            )
        )
    return ModelPlan(plans, model.norm)


def _hooked(model) -> bool:
    """Whether a torch forward hook would run in the modules whose calls this forward skips:
    any but the SnapKV observer's pre-hooks on attention layers, which act only on prefill."""
    from torch.nn.modules import module as torch_module

    from sglang_magicdec.observer import WindowObserver

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for submodule in model.modules():
        if submodule._forward_hooks:
            return True
        for hook in submodule._forward_pre_hooks.values():
            if getattr(hook, "__func__", None) is not WindowObserver._capture:
                return True
    return False


def _dispatches_to(op, forward) -> bool:
    """Whether SGLang's fused op `op` runs our native `forward` (not a pinned torch path)."""
    method = op._forward_method
    if method is None:
        method = op._forward_method = op._resolve_forward_method()
    return getattr(method, "__func__", None) is forward
