"""The pre-norm decoder layer that remat's model families share:

    o = norm_attention(x)                    (norm, q/k/v projections, rope, flash attention)
    h = x + dropout(out_proj(o))
    y = h + dropout(mlp_block(h))            (a fused pre-norm MLP sub-block)

A family (remat.models.<family>) subclasses :class:`PreNormDecoderLayer` with its parameter
layout: what the attention sub-block is given (:meth:`attention_output`), the output projection
(:meth:`out_proj`) and the MLP sub-block (:meth:`mlp_block`). The policy decides what the two
fused sub-blocks keep for backward, the same way for every family.

``out_proj`` and ``mlp_block`` return what is added to the residual stream, so a family whose
sub-blocks end in a norm before the residual add (Gemma's "sandwich" post-norms) applies it there:
``h = x + dropout(post_norm(out_proj(o)))``.
"""

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from remat import checks, functional
from remat.models.hf import refuse_kv_cache

LAYER_POLICIES = ("speed", "balanced", "memory")


class PreNormDecoderLayer(nn.Module):
    """Base of the fused decoder layers. Subclasses set ``policy`` (one of :data:`LAYER_POLICIES`),
    ``backend`` and ``resid_dropout`` (a probability applied in training, default 0) and implement
    the three hooks below.

    Policies (what the fused sub-blocks keep; the norms, rope, the attention probabilities and the
    MLP activation are always recomputed):

    - ``"speed"``: q, k, v and the MLP's pre-activations: no GEMM is recomputed.
    - ``"balanced"``: q, k, v; the MLP's first GEMM(s) are recomputed from its input.
    - ``"memory"``: neither; the q/k/v projections are recomputed too.

    Gradient checkpointing of the whole layer: set ``layer.gradient_checkpointing = True`` (what
    Hugging Face's ``model.gradient_checkpointing_enable()`` does on a patched model, and what
    remat's planner does per layer). Then, in training mode with grad enabled, the layer keeps only
    its input hidden states (plus the position ids or rope tables the caller passes) and re-runs its
    fused forward in backward, under ``layer._gradient_checkpointing_func`` (default
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which restores the RNG state, so
    dropout masks and gradients are bitwise those of the run without it). Hugging Face's
    ``every_n_layers`` is not honoured: its loop counts GradientCheckpointingLayer instances only, so
    every remat layer gets the flag.
    """

    resid_dropout = 0.0
    # Gradient checkpointing of the whole layer (Hugging Face's attribute names, so that
    # model.gradient_checkpointing_enable() / _disable() and TrainingArguments(gradient_checkpointing=True)
    # reach it; remat's planner sets the flag per layer too). When True, in training mode with grad
    # enabled, the layer runs under _gradient_checkpointing_func: it keeps only its input and re-runs
    # the fused forward in backward (once: the layer handles the flag itself and is no
    # GradientCheckpointingLayer, whose forward wrapper would checkpoint a second time).
    gradient_checkpointing = False
    _gradient_checkpointing_func = staticmethod(functools.partial(torch.utils.checkpoint.checkpoint,
                                                                  use_reentrant=False))

    @classmethod
    def _empty(cls, policy, backend):
        """An instance without submodules, for ``from_module`` to fill with the stock layer's (shared)
        modules and parameters."""
        checks.check_choice(policy, "policy", LAYER_POLICIES)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.policy, module.backend = policy, backend
        return module

    @property
    def keeps_qkv(self):
        """Whether the attention sub-block keeps q, k, v (policies speed and balanced)."""
        return self.policy != "memory"

    @property
    def mlp_recompute(self):
        """The MLP sub-block's recompute mode: "activation" (speed) or "block"."""
        return "activation" if self.policy == "speed" else "block"

    def attention_output(self, x, position_ids, position_embeddings):
        """o ``[B, N, Hq, D]`` of the attention sub-block (through functional.norm_attention with
        ``keep_qkv=self.keeps_qkv``)."""
        raise NotImplementedError

    def out_proj(self, o):
        """The attention output projection of o ``[B, N, Hq * D]``: what is added to the residual
        stream (a family's post-norm included)."""
        raise NotImplementedError

    def mlp_block(self, h):
        """The MLP sub-block's output for the residual stream h (pre-norm included, and a family's
        post-norm; through functional.norm_mlp or norm_gelu_mlp with
        ``recompute=self.mlp_recompute``)."""
        raise NotImplementedError

    def _dropout(self, t):
        if self.resid_dropout == 0:
            return t
        return functional.dropout(t, self.resid_dropout, self.training, backend=self.backend)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        """hidden_states ``[B, N, hidden]`` -> ``[B, N, hidden]``. ``attention_mask`` must be None
        (causal attention; remat.patch checks a Hugging Face model's padding mask).
        ``position_ids`` / ``position_embeddings=(cos, sin)`` as the family's attention takes them.
        A KV cache among ``kwargs`` raises (remat's layers are for training)."""
        if attention_mask is not None:
            raise ValueError(f"{type(self).__name__} does causal attention and takes no attention_mask; for Hugging "
                             "Face models use remat.patch, which checks the model's padding mask")
        refuse_kv_cache(kwargs)
        x = hidden_states
        checks.check_hidden_states(x)
        checks.check_input(x)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # Positional arguments only: a reentrant checkpoint function sees only those as inputs.
            return self._gradient_checkpointing_func(self._fused_forward, x, position_ids, position_embeddings)
        return self._fused_forward(x, position_ids, position_embeddings)

    def _fused_forward(self, x, position_ids, position_embeddings):
        batch, n, _ = x.shape
        o = self.attention_output(x, position_ids, position_embeddings)
        h = x + self._dropout(self.out_proj(o.reshape(batch, n, -1)))
        return h + self._dropout(self.mlp_block(h))
