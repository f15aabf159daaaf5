"""Small model classes that misbehave on purpose, for ``tpify verify``'s tests (tests/distributed/test_verify.py).

They live in a module of their own (``tests/`` is on ``sys.path``, see conftest.py) so that the
ranks ``tpify.authoring.verify.verify_many`` launches can unpickle them by name.

* ``Float64Refusing*``: a family whose kernel refuses float64 the way transformers' fused-experts
  kernel does (``torch.nn.functional.grouped_mm`` raises ``RuntimeError: Expected mat_a to be
  Float32, BFloat16 or Float16 matrix, got Double``): each MLP activation raises that error on a
  float64 input and is the family's own activation otherwise. verify must fall back to float32.
* ``NaNLlamaModel``: a Llama with a NaN in its final norm weight: the dense model is not finite on any
  input, which verify must report as such (``dense reference not finite``), not as a difference
  of the parallel model.
* ``BiasOnEveryRankGPT2LMHeadModel``: gpt2 whose MLP output gets its ``c_proj`` bias ``tp_size``
  times once that layer is tpify's ``RowParallelLinear``: the effect of a row-parallel layer
  adding its bias on every rank before the all-reduce instead of once after it. Its own init
  sets that bias to zero, so verify catches it only with the constants perturbed.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Model, LlamaModel

# torch.nn.functional.grouped_mm's message for a float64 input (torch 2.13, CPU)
GROUPED_MM_REFUSAL = "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"


class Float64Refusing(nn.Module):
    """``inner(x)``, except that a float64 ``x`` raises what grouped_mm raises."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            raise RuntimeError(GROUPED_MM_REFUSAL)
        return self.inner(x)


class Float64RefusingLlamaModel(LlamaModel):
    """LlamaModel whose MLP activations refuse float64 (no parameters added: the checkpoint is Llama's)."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.mlp.act_fn = Float64Refusing(layer.mlp.act_fn)


class Float64RefusingGPT2Model(GPT2Model):
    """GPT2Model whose MLP activations refuse float64."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.h:
            block.mlp.act = Float64Refusing(block.mlp.act)


class NaNLlamaModel(LlamaModel):
    """LlamaModel with a NaN in its final norm weight: NaN outputs on every input (one element:
    a parameter NaN throughout would be taken for one the init left uninitialised and drawn again,
    tpify.authoring.reference.build_seeded)."""

    def __init__(self, config):
        super().__init__(config)
        with torch.no_grad():
            self.norm.weight[0] = float("nan")


class NoRotaryLlamaModel(LlamaModel):
    """LlamaModel without its rotary embedding: its own forward raises (calling None) inside
    transformers' modeling code, as a family broken in transformers does (llama4 in 5.24)."""

    def __init__(self, config):
        super().__init__(config)
        self.rotary_emb = None


# ---------------------------------------------------------------------------------------------
# A parameter per KV head (as doge's DogeAttention.A): Llama whose attention scales each KV head's
# values by its own ``kv_gate`` value. At tp_size above the KV heads each value is held by the
# ranks whose query heads read that KV head, its gradient summed over them (tpify.styles.per_head).

from transformers import LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama as _llama  # noqa: E402


class KVGatedLlamaAttention(_llama.LlamaAttention):
    """LlamaAttention with ``kv_gate (num_key_value_heads,)``: each KV head's values times its gate."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.kv_gate = nn.Parameter(torch.randn(config.num_key_value_heads))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, n, T, d)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, kv, T, d)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = value_states * self.kv_gate.view(1, -1, 1, 1).to(value_states.dtype)
        cos, sin = position_embeddings
        query_states, key_states = _llama.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = _llama.eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def _kv_gated(model: nn.Module, config) -> None:
    for i, layer in enumerate(model.layers):
        layer.self_attn = KVGatedLlamaAttention(config, i)


class KVGatedLlamaModel(LlamaModel):
    """LlamaModel whose attention holds a parameter per KV head (KVGatedLlamaAttention)."""

    def __init__(self, config):
        super().__init__(config)
        _kv_gated(self, config)


class KVGatedLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose attention holds a parameter per KV head (KVGatedLlamaAttention)."""

    def __init__(self, config):
        super().__init__(config)
        _kv_gated(self.model, config)


# ---------------------------------------------------------------------------------------------
# A mistake only a non-zero bias reveals: a row-parallel layer's bias added on every rank (before
# the all-reduce) instead of once. Simulated by a forward hook on gpt2's MLP, active only when its
# c_proj is tpify's RowParallelLinear (the dense model is gpt2's own): the output gets the bias
# tp_size - 1 more times, what the all-reduce of tp_size partial sums each holding the bias gives.
# Detached, as in that mistake: each rank's bias still gets the output's gradient once (the
# all-reduce's backward is the identity), so only the forward is wrong, by (tp_size - 1) * bias.

from transformers import GPT2LMHeadModel  # noqa: E402


def _bias_on_every_rank(mlp: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    from tpify.layers import RowParallelLinear

    if isinstance(mlp.c_proj, RowParallelLinear) and mlp.c_proj.bias is not None:
        return output + (mlp.c_proj.tp_size - 1) * mlp.c_proj.bias.detach()
    return output


class BiasOnEveryRankGPT2LMHeadModel(GPT2LMHeadModel):
    """gpt2's causal LM whose row-parallel MLP ``c_proj`` adds its bias on every rank (see above)."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.transformer.h:
            block.mlp.register_forward_hook(_bias_on_every_rank)
