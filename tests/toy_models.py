"""Small model families defined here, not in transformers, for tests whose subject is a property of
a model's code (a constant reshape, ...): transformers changes its own families between releases,
and a test that names one tests that release, not tpify."""

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class ConstantReshapeConfig(PretrainedConfig):
    """The config of :class:`ConstantReshapeForCausalLM` (standard attribute names)."""

    model_type = "tpify_constant_reshape"

    def __init__(self, vocab_size=64, hidden_size=64, num_attention_heads=8, num_hidden_layers=2,
                 intermediate_size=128, **kwargs):
        self.vocab_size, self.hidden_size, self.num_attention_heads = vocab_size, hidden_size, num_attention_heads
        self.num_hidden_layers, self.intermediate_size = num_hidden_layers, intermediate_size
        super().__init__(**kwargs)


class ConstantReshapeAttention(nn.Module):
    """CodeGen's attention up to transformers 5.23: the fused ``qkv_proj`` output is reshaped
    into a constant 4 chunks (the model-parallel shards it was trained with), each ``[q|v|k]``
    for a quarter of the heads; 4 equals a 4-head config's head count only by chance. The 4 is a
    local of ``forward``, so no recipe can divide it."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.out_proj = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        mp_num = 4
        qkv = self.qkv_proj(x).reshape(b, t, mp_num, -1)  # (B, T, 4, 3H/4)
        local = self.num_heads * self.head_dim // mp_num
        q, v, k = (y.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for y in torch.split(qkv, local, dim=-1))  # (B, nh, T, hd)
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden_size)
        self.attn = ConstantReshapeAttention(config)
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.fc_out(torch.relu(self.fc_in(self.ln(x))))


class ConstantReshapeForCausalLM(PreTrainedModel):
    """A two-block causal LM around :class:`ConstantReshapeAttention` (no loss, no cache)."""

    config_class = ConstantReshapeConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, **kwargs):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return CausalLMOutput(logits=self.lm_head(x))
