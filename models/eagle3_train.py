"""Training an EAGLE-3 head for a checkpoint (`atoll spec train-eagle3`), after SpecForge's recipe:

- data: the target's own greedy continuations of a prompt set (the caller generates them); one
  transformers forward per sequence gives the three layers' hidden states (hidden_states[i],
  layer i's input, as the runtime's hooks take it) and the target's argmax at each position;
- the draft vocabulary: the `draft_vocab` target tokens most frequent among those argmaxes,
  in id order, with d2t (draft id -> target id offset) and t2d (the target ids it holds);
- training-time test: the head is unrolled `ttt` steps on its own outputs. Step k at position
  i + k reads its step k-1 output there and the true token t_{i+1+k}, and attends to step 0's
  keys at positions <= i and to its own earlier steps' keys at i (the cache a chain draft
  sees), predicting the target's argmax at i + 1 + k;
- the loss: cross-entropy over the draft vocabulary on the continuation's positions (labels
  outside the draft vocabulary skipped), step k weighted 0.8**k; AdamW with a linear warmup,
  gradients clipped at 0.5; a step takes a batch of sequences, right-padded (a row attends only
  to earlier positions, so padding changes nothing that counts). SpecForge uses the target's soft distribution (over the draft vocabulary) as the label;
  here the label is the target's argmax, which for greedy continuations is the next token.

The head starts from the target's final norm and its LM head's rows of the draft vocabulary;
the embedding is the target's, frozen and not saved (the runtime shares the target's). The
result is written in the published layout (models/eagle3.py: save_head).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from atoll.errors import InputError
from atoll.models.config import ModelConfig
from atoll.models.eagle3 import head_config, save_head

DECAY = 0.8  # step k's loss weight is DECAY ** k
CLIP = 0.5


class Norm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone().float()), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(n_in: int, n_out: int, scale: float = 1.0) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.mul_(scale)
    return layer


class TrainHead(nn.Module):
    """The head with the published parameter names (its state_dict is the file's tensors)."""

    def __init__(self, cfg: dict, final_norm: torch.Tensor, lm_rows: torch.Tensor):
        super().__init__()
        h, eps, d = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["head_dim"]
        q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
        self.cfg = cfg
        self.fc = _linear(3 * h, h)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm, m.hidden_norm = Norm(torch.ones(h), eps), Norm(torch.ones(h), eps)
        m.self_attn = nn.Module()
        a = m.self_attn
        a.q_proj, a.k_proj, a.v_proj, a.o_proj = _linear(2 * h, q), _linear(2 * h, kv), _linear(2 * h, kv), _linear(q, h)
        m.post_attention_layernorm = Norm(torch.ones(h), eps)
        m.mlp = nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = _linear(h, inter), _linear(h, inter), _linear(inter, h)
        self.norm = Norm(final_norm, eps)
        self.lm_head = nn.Linear(h, lm_rows.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_rows)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rotary(self, x, positions):
        ang = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def unroll(self, aux, emb, labels, weights, steps: int, mean: bool = True):
        """A batch of right-padded sequences: aux [B, T, 3H] the fused layers' states; emb [B, T, H]
        the tokens' embeddings; labels [B, T] the draft id of the target's argmax at each position
        (-1: none); weights [B, T] 1 where a position's prediction counts (0 on padding). A row sees
        only positions at or before its own, so padding on the right changes no counted row.
        Returns (loss, [(correct, counted, summed cross-entropy)] a step); the loss is each step's
        mean over the batch's counted positions (its sum where not `mean`), weighted DECAY ** k."""
        cfg, a, m = self.cfg, self.midlayer.self_attn, self.midlayer
        heads, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        b, n = labels.shape[0], labels.shape[1] - 1
        g = self.fc(aux[:, :n])
        keys, values, total, stats = [], [], 0.0, []
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        for k in range(min(steps, n)):
            rows = n - k
            x = torch.cat([m.input_layernorm(emb[:, 1 + k:1 + k + rows]), m.hidden_norm(g[:, :rows])], dim=-1)
            pos = torch.arange(rows) + k
            q = self._rotary(a.q_proj(x).view(b, rows, heads, d).transpose(1, 2), pos)
            kk = self._rotary(a.k_proj(x).view(b, rows, kvh, d).transpose(1, 2), pos)
            keys.append(kk.repeat_interleave(heads // kvh, 1))
            values.append(a.v_proj(x).view(b, rows, kvh, d).transpose(1, 2).repeat_interleave(heads // kvh, 1))
            # step 0's keys, causal; then each later step's own key at the same row (the diagonal)
            s0 = q @ keys[0].transpose(-1, -2) / math.sqrt(d)  # [B, heads, rows, n]
            s0 = s0.masked_fill(causal[:rows], float("-inf"))
            diag = [(q * keys[j][:, :, :rows]).sum(-1, keepdim=True) / math.sqrt(d) for j in range(1, k + 1)]
            p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
            out = p[..., :n] @ values[0]
            for j in range(1, k + 1):
                out = out + p[..., n + j - 1:n + j] * values[j][:, :, :rows]
            residual = g[:, :rows] + a.o_proj(out.transpose(1, 2).reshape(b, rows, heads * d))
            h = m.post_attention_layernorm(residual)
            g = residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))
            lab, w = labels[:, 1 + k:1 + k + rows], weights[:, 1 + k:1 + k + rows]
            keep = (lab >= 0) & (w > 0)
            if keep.any():
                logits = self.lm_head(self.norm(g[keep]))  # [counted, draft vocab]
                ce = F.cross_entropy(logits, lab[keep], reduction="sum")
                total = total + DECAY ** k * (ce / int(keep.sum()) if mean else ce)
                stats.append((int((logits.argmax(-1) == lab[keep]).sum()), int(keep.sum()), float(ce.detach())))
            else:
                stats.append((0, 0, 0.0))
        return total, stats


def pad_batch(items, embed: torch.Tensor, to_draft: torch.Tensor):
    """[(tokens, aux, argmax, weights)] -> the right-padded tensors `unroll` takes."""
    t = max(len(tokens) for tokens, _, _, _ in items)
    b, width = len(items), items[0][1].shape[-1]
    aux, tokens = torch.zeros(b, t, width), torch.zeros(b, t, dtype=torch.long)
    labels, weights = torch.full((b, t), -1, dtype=torch.long), torch.zeros(b, t)
    for i, (tok, states, argmax, counted) in enumerate(items):
        n = len(tok)
        aux[i, :n], tokens[i, :n], labels[i, :n], weights[i, :n] = states, tok, to_draft[argmax], counted
    return aux, embed[tokens], labels, weights


@torch.no_grad()
def collect(target_dir, sequences, aux: list[int], *, progress: bool = False):
    """[(tokens, prompt_len)] -> ([(tokens, aux [T, 3H], argmax [T], weights [T])], the target's
    embedding, LM head and final norm), from one transformers forward each (its
    hidden_states[i] is layer i's input)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise InputError("atoll spec train-eagle3 reads the target's hidden states with transformers: "
                         "pip install 'atoll[convert]'") from None
    from tqdm import tqdm

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = []
    for tokens, prompt_len in tqdm(sequences, unit="sequence", desc="target states", disable=not progress,
                                   dynamic_ncols=True, mininterval=1.0):
        res = model(torch.tensor([tokens]), output_hidden_states=True)
        states = torch.cat([res.hidden_states[i][0] for i in aux], dim=-1)
        weights = torch.zeros(len(tokens))
        weights[prompt_len - 1:] = 1.0  # the target's predictions of its own continuation
        out.append((torch.tensor(tokens), states, res.logits[0].argmax(-1), weights))
    return out, {"embed": model.get_input_embeddings().weight.detach(),
                 "lm_head": model.get_output_embeddings().weight.detach(), "norm": model.model.norm.weight.detach()}


def draft_vocab(data, size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids most often the target's argmax where the loss counts, in id order
    (filled up with the lowest unused ids when fewer occur)."""
    counts = Counter(t for _, _, argmax, w in data for t in argmax[w > 0].tolist())
    ids = [t for t, _ in counts.most_common(size)]
    seen = set(ids)
    ids += [t for t in range(vocab) if t not in seen][:size - len(ids)]
    return torch.tensor(sorted(ids))


def train_head(target_dir, sequences, out_dir, *, steps: int, seconds: float | None, ttt: int, vocab_size: int,
               lr: float = 1e-3, seed: int = 0, progress: bool = True, batch: int = 8, warmup: int = 50) -> dict:
    """Trains a head on [(tokens, prompt_len)], `batch` sequences a step (drawn at random, padded),
    the learning rate rising linearly over `warmup` steps, and writes it to out_dir; returns a
    summary."""
    from tqdm import tqdm

    target = ModelConfig.load(target_dir)
    layers = target.num_hidden_layers
    aux = [2, layers // 2, layers - 3]
    if not sequences:
        raise InputError("atoll spec train-eagle3: no training sequences")
    data, weights = collect(target_dir, sequences, aux, progress=progress)
    vocab_size = min(vocab_size, target.vocab_size)
    ids = draft_vocab(data, vocab_size, target.vocab_size)
    to_draft = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    counted = [to_draft[argmax[w > 0]] for _, _, argmax, w in data]
    covered = sum(int((c >= 0).sum()) for c in counted) / max(sum(len(c) for c in counted), 1)
    cfg = head_config(target, draft_vocab_size=len(ids), aux=aux)
    torch.manual_seed(seed)
    head = TrainHead(cfg, weights["norm"], weights["lm_head"][ids])
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / (warmup + 1)))
    rng = random.Random(seed)
    start, done, hits, losses = time.monotonic(), 0, [[0, 0] for _ in range(ttt)], []
    bar = tqdm(total=steps, unit="step", disable=not progress, dynamic_ncols=True, mininterval=0.5)
    while done < steps and (seconds is None or time.monotonic() - start < seconds):
        items = [data[rng.randrange(len(data))] for _ in range(min(batch, len(data)))]
        loss, stats = head.unroll(*pad_batch(items, weights["embed"], to_draft), ttt)
        if not torch.is_tensor(loss):
            continue
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), CLIP)
        opt.step()
        sched.step()
        done += 1
        losses.append(loss.item())
        for k, (c, n, _) in enumerate(stats):
            hits[k][0] += c
            hits[k][1] += n
        bar.set_postfix_str(f"loss {losses[-1]:.3f} acc@0 {stats[0][0] / max(stats[0][1], 1):.2f}", refresh=False)
        bar.update(1)
    bar.close()
    tensors = {n: t for n, t in head.state_dict().items()}
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    save_head(out_dir, tensors, cfg)
    return {"steps": done, "seconds": time.monotonic() - start, "sequences": len(sequences),
            "tokens": sum(len(t) for t, _ in sequences), "counted": sum(len(c) for c in counted),
            "batch": batch, "draft_vocab": len(ids), "vocab_coverage": covered, "aux_layers": aux,
            "accuracy": [c / n if n else None for c, n in hits], "losses": losses}
