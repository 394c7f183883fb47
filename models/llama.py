"""The Llama family as transformers defines it: Llama 2/3, Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), tied or untied embeddings. Holds this rank's pipeline stage
only; module names mirror transformers' so checkpoint names map one to one."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from atoll.layers.attention import AttentionMetadata, attend, reads_in_place, write_cache
from atoll.layers.context_parallel import CpShards
from atoll.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atoll.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from atoll.layers.mlp import GatedMLP
from atoll.layers.norm import RMSNorm
from atoll.layers.prefill import fresh_prefill
from atoll.layers.rotary import RotaryEmbedding
from atoll.models.config import ModelConfig
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.pipeline import stage_layers

# the layers whose weight goes through layers.packed.linear
LINEAR_KINDS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ParallelLMHead)

_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def dense_targets(name: str, *, tied: bool = False) -> list[tuple[str, object]]:
    """(parameter name, shard id) pairs that read checkpoint tensor `name`: q/k/v into qkv_proj,
    gate/up into gate_up_proj, and with tied embeddings the embedding into lm_head too."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        merged, shard = _STACKED[parts[-2]]
        return [(".".join(parts[:-2] + [merged, parts[-1]]), shard)]
    if name == "model.embed_tokens.weight" and tied:
        return [(name, None), ("lm_head.weight", None)]
    return [(name, None)]


def dense_source(param: str, shard) -> str:
    """The checkpoint tensor that fills `shard` of `param` (dense_targets backwards)."""
    for part, (merged, s) in _STACKED.items():
        if s == shard and f".{merged}." in param:
            return param.replace(f".{merged}.", f".{part}.")
    return param


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary: RotaryEmbedding, dtype):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, ctx.tp, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, ctx.tp, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.sliding_window = cfg.sliding_window  # LlamaModel sets each layer's own (ModelConfig.window_of)

    def forward(self, x, meta: AttentionMetadata, k_cache, v_cache):
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        d = self.head_dim  # head counts spelled out: a replica's micro-batch may have no tokens
        q = q.view(len(x), q.shape[-1] // d, d)  # [tokens, heads/tp, head_dim]
        k = k.view(len(x), k.shape[-1] // d, d)  # [tokens, kv_heads/tp (>= 1), head_dim]
        v = v.view(len(x), v.shape[-1] // d, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, meta.positions)
        if self.sliding_window and getattr(meta, "windowed", None) is not None:
            meta = meta.windowed  # this layer's cache is the sliding layers' own (engine.kv.windowed)
        # k, v as attention reads them: a quantized cache's stored values (layers/attention.py)
        k, v = write_cache(k_cache, v_cache, k, v, meta)
        if isinstance(meta, CpShards):  # context parallel: partials over each cp rank's blocks, merged
            return self.o_proj(meta.attend(q, k_cache, v_cache, sliding_window=self.sliding_window).flatten(1))
        out = None if reads_in_place(q, k_cache) else \
            fresh_prefill(q, k, v, meta, sliding_window=self.sliding_window)  # None: not such a step
        if out is None:
            out = attend(q, k_cache, v_cache, meta, sliding_window=self.sliding_window)
        return self.o_proj(out.flatten(1))  # [tokens, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary, dtype, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(cfg, ctx, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.tp, dtype=dtype)

    def forward(self, x, residual, meta, k_cache, v_cache):
        """The residual stream is h = residual + x (residual None: h = x, the first layer of a
        stage); returns the next layer's (x, residual). Each add is fused into the norm after
        it (kernels.rms_norm with residual: the sum is rounded to the stream's dtype as an add
        would, and written into residual in place), one kernel fewer per add."""
        h, residual = self._attention(x, residual, meta, k_cache, v_cache)
        return self.mlp(h), residual

    def forward_steps(self, x, residual, meta, k_cache, v_cache, overlap: bool = False):
        """forward as an overlapped step (comm/pending.py): an MoE MLP yields while its
        exchanges fly (two-batch overlap, engine/step/two_batch.py)."""
        h, residual = self._attention(x, residual, meta, k_cache, v_cache)
        steps = getattr(self.mlp, "forward_steps", None)
        h = (yield from steps(h, overlap)) if steps is not None else self.mlp(h)
        return h, residual

    def _attention(self, x, residual, meta, k_cache, v_cache):
        """The residual block's first half: (the MLP's input, the residual stream)."""
        if residual is None:
            residual = x.clone()  # the stage's input stays as it came (a CUDA graph's buffer)
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual=residual)
        return self.post_attention_layernorm(self.self_attn(h, meta, k_cache, v_cache), residual=residual), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, start: int, end: int, dtype, make_mlp=None):
        super().__init__()
        self.start, self.end = start, end
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        if ctx.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)
        # keyed by global layer index, so parameter names match the checkpoint's
        self.layers = nn.ModuleDict({
            str(i): LlamaDecoderLayer(cfg, ctx, rotary, dtype, make_mlp(i) if make_mlp else None)
            for i in range(start, end)
        })
        for i, layer in self.layers.items():
            layer.self_attn.sliding_window = cfg.window_of(int(i))
        if ctx.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, dtype=torch.float32, make_mlp=None):
        super().__init__()
        self.config = cfg
        self.ctx = ctx
        start, end = stage_layers(cfg, ctx.layout.pp)[ctx.coords.pp]
        self.model = LlamaModel(cfg, ctx, start, end, dtype, make_mlp)
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)
            if cfg.tie_word_embeddings and ctx.is_first_stage:  # one tensor, as the checkpoint has
                self.lm_head.weight = self.model.embed_tokens.weight  # the same vocab shard

    @property
    def num_local_layers(self) -> int:
        return self.model.end - self.model.start

    def step_layers(self) -> list[nn.Module]:
        """The stage's decoder layers, which a compiled decode step may capture one graph a
        layer kind: each takes forward(x, residual, meta, k_cache, v_cache) and returns the
        next (x, residual), as LlamaDecoderLayer does. A model whose layers do not keep that
        contract returns [] (the whole stage is then one graph)."""
        return list(self.model.layers.values())

    def linear_layers(self) -> list[nn.Module]:
        """This stage's linear layers, whose weight each multiplies by through layers.packed.linear
        with its own packs: what the decode step may pack for oneDNN or MKL."""
        return [m for m in self.modules() if isinstance(m, LINEAR_KINDS)]

    def linear_weights(self) -> list[torch.Tensor]:
        """The weights of linear_layers (their bytes: what a packed copy costs)."""
        return [m.weight for m in self.linear_layers()]

    @contextmanager
    def static_exchange(self, real=None):
        """Steps run inside take each MoE layer's fixed-shape exchange (a CUDA graph's step:
        no host read of a device value), real: [rows] bool its rows that are not padding; a
        dense model has none."""
        yield self

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache) -> torch.Tensor:
        """x: token ids [tokens] on the first stage, else hidden [tokens, hidden].
        Returns hidden [tokens, hidden], or on the last stage the logits [seqs, vocab] of
        each sequence's last token."""
        h = self.model.embed_tokens(x) if self.ctx.is_first_stage else x
        residual = None
        for j, layer in enumerate(self.model.layers.values()):
            h, residual = layer(h, residual, meta, cache.k[j], cache.v[j])
        return self._out(h, residual, meta)

    def forward_steps(self, x: torch.Tensor, meta: AttentionMetadata, cache, overlap: bool = False):
        """forward as an overlapped step, eager (comm/pending.py): its MoE layers yield while
        their exchanges fly; two-batch overlap drives two micro-batches' steps in turns."""
        h = self.model.embed_tokens(x) if self.ctx.is_first_stage else x
        residual = None
        for j, layer in enumerate(self.model.layers.values()):
            h, residual = yield from layer.forward_steps(h, residual, meta, cache.k[j], cache.v[j], overlap)
        return self._out(h, residual, meta)

    def _out(self, h, residual, meta) -> torch.Tensor:
        """The stage's output from the last layer's (h, residual): the hidden stream, or logits."""
        if not self.ctx.is_last_stage:
            return h if residual is None else residual + h
        if isinstance(meta, CpShards) and not meta.is_decode:  # each cp rank's rows -> the step's
            h, residual = meta.gather_rows(h if residual is None else residual + h), None
        if not meta.is_decode:  # decode: one token per sequence, every row is a last token
            rows = meta.last_tokens()
            h, residual = h[rows], None if residual is None else residual[rows]
        return self.lm_head(self.model.norm(h, residual=residual) if residual is not None else self.model.norm(h))

    def checkpoint_targets(self, name: str) -> list[tuple[str, object]]:
        return dense_targets(name, tied=self.config.tie_word_embeddings)

    def checkpoint_name(self, param: str, shard) -> str:
        return dense_source(param, shard)
