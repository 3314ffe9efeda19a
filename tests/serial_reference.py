"""A plain single-process transformer block: the reference every parallel layer is compared with."""

import math

import torch
import torch.nn.functional as F

from fourfold.spec.blockspec import BlockConfig


def norm(h, w, b, kind, eps):
    if kind == "layer":
        return F.layer_norm(h, h.shape[-1:], w, b, eps)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(t, positions, theta):
    d = t.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)  # float32, as transformers does
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)
    rotated = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], dim=-1)
    return t * emb.cos().to(t.dtype) + rotated * emb.sin().to(t.dtype)


def linear(h, w, name):
    out = h @ w[name].T
    return out + w[name + ".bias"] if name + ".bias" in w else out


def attention(h, w, cfg: BlockConfig, p):
    b, s, _ = h.shape
    d = cfg.head_dim
    q = linear(h, w, f"{p}.q").view(b, s, cfg.heads, d).transpose(1, 2)
    k = linear(h, w, f"{p}.k").view(b, s, cfg.kv_heads, d).transpose(1, 2)
    v = linear(h, w, f"{p}.v").view(b, s, cfg.kv_heads, d).transpose(1, 2)
    if cfg.rope:
        pos = torch.arange(s)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    rep = cfg.heads // cfg.kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = scores.softmax(-1) @ v
    return linear(o.transpose(1, 2).reshape(b, s, cfg.hidden), w, f"{p}.o")


def mlp(h, w, cfg: BlockConfig, p):
    if cfg.gated:
        a = F.silu(linear(h, w, f"{p}.gate")) * linear(h, w, f"{p}.up")
    else:
        a = F.gelu(linear(h, w, f"{p}.fc"), approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
    return linear(a, w, f"{p}.down")


def block(h, w, cfg: BlockConfig, p="block"):
    def n(x, name):
        return norm(x, w[f"{p}.{name}.weight"], w.get(f"{p}.{name}.bias"), cfg.norm, cfg.eps)

    h = h + attention(n(h, "attn_norm"), w, cfg, f"{p}.attn")
    return h + mlp(n(h, "mlp_norm"), w, cfg, f"{p}.mlp")


def random_block_weights(cfg: BlockConfig, seed: int, dtype=torch.float64, p="block"):
    """Every weight random (norm weights near 1, biases included when the config has them)."""
    g = torch.Generator().manual_seed(seed)
    d = cfg.head_dim

    def r(*shape, scale=0.3, centre=0.0):
        return centre + scale * torch.randn(*shape, generator=g, dtype=dtype)

    shapes = {f"{p}.attn.q": (cfg.heads * d, cfg.hidden), f"{p}.attn.k": (cfg.kv_heads * d, cfg.hidden),
              f"{p}.attn.v": (cfg.kv_heads * d, cfg.hidden), f"{p}.attn.o": (cfg.hidden, cfg.heads * d),
              f"{p}.mlp.down": (cfg.hidden, cfg.ffn)}
    if cfg.gated:
        shapes.update({f"{p}.mlp.gate": (cfg.ffn, cfg.hidden), f"{p}.mlp.up": (cfg.ffn, cfg.hidden)})
    else:
        shapes[f"{p}.mlp.fc"] = (cfg.ffn, cfg.hidden)
    w = {}
    for name, shape in shapes.items():
        w[name] = r(*shape)
        kind = name.rsplit(".", 1)[1]
        if cfg.out_bias if kind == "o" else cfg.qkv_bias if kind in "qkv" else cfg.mlp_bias:
            w[name + ".bias"] = r(shape[0], scale=0.1)
    for n in ("attn_norm", "mlp_norm"):
        w[f"{p}.{n}.weight"] = r(cfg.hidden, scale=0.1, centre=1.0)
        if cfg.norm == "layer":
            w[f"{p}.{n}.bias"] = r(cfg.hidden, scale=0.1)
    return w


def saved_random_model(config: dict, path, scale=lambda name: 0.05, **options):
    """A transformers model of `config` (a config.json's fields) in float64, every parameter moved
    off its initial value (`scale(name)` times a normal: biases non-trivial too), saved to `path`."""
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, **{"attn_implementation": "sdpa", **options})
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(scale(name) * torch.randn_like(p))
    model.save_pretrained(path)
    return hf_config, model


def cp_shard(t, cp, rank):
    """Chunks rank and 2cp-1-rank of the sequence (dim 1): what context parallelism gives a rank."""
    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1) if cp > 1 else t


def relative_error(got, ref):
    """The largest error relative to the largest reference value (an all-zero reference, such as an
    expert no token chose, counts absolutely)."""
    scale = ref.abs().max()
    return ((got - ref).abs().max() / (scale if scale > 0 else 1)).item()


def saved_gradients(model, path) -> dict:
    """A transformers model's gradients under its checkpoint's names and layout (experts one by one,
    as transformers saves them): the model's parameters set to their gradients and saved to
    `path`/grads, then read back."""
    from safetensors.torch import load_file

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(path / "grads")
    return load_file(path / "grads" / "model.safetensors")


def adamw_groups(model, weight_decay: float) -> list[dict]:
    """torch AdamW's parameter groups for fourfold's own model on one rank: weight decay on the
    matrices (parameters whose serial tensor has two dims; the local ones are flat), none on norms
    and biases, as fourfold's AdamW decays them."""
    from fourfold.parallel.tensor.params import layouts

    matrix = {p: all(len(piece.serial_shape) >= 2 for piece in layout.pieces) for p, layout in layouts(model).items()}
    return [{"params": [p for p, m in matrix.items() if m], "weight_decay": weight_decay},
            {"params": [p for p, m in matrix.items() if not m], "weight_decay": 0.0}]


def hf_adamw_groups(model, weight_decay: float) -> list[dict]:
    """The same groups for a transformers model (as Hugging Face's Trainer makes them): no decay on
    1-D parameters (norms, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def sum_replicated_grads(module, grid) -> None:
    """All-reduce the gradient of each replicated parameter over its layout's `grad_sum` dims
    (the dims its tokens or its filled slice were split over), as GradientSync's buckets sum them
    in a run; for tests that call backward without GradientSync. Weight shards need nothing here."""
    from fourfold.parallel import comm
    from fourfold.parallel.tensor.params import layouts

    for p, layout in layouts(module).items():
        if p.grad is not None and layout.grad_sum:
            comm.all_reduce(p.grad, grid.group(layout.grad_sum))


# transformers' own arithmetic in the input's dtype (float64 references otherwise float32-accurate)

def rms_norm_in_input_dtype(self, h):
    # transformers' LlamaRMSNorm computes in float32 whatever the input: a float64 reference
    # would be float32-accurate. This is the same formula in the input's dtype.
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def router_in_input_dtype(self, hidden_states):
    # transformers' routers (MixtralTopKRouter, Qwen2MoeTopKRouter) take the softmax in float32
    # whatever the input; this is the same arithmetic in the input's dtype (fourfold's: float32 at least).
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    values, indices = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values, indices


def load_balancing_in_input_dtype(gate_logits, num_experts, top_k, attention_mask=None):
    # transformers' load_balancing_loss_func (no mask) accumulated in the logits' dtype instead of float32
    counts = probs = 0
    for logits in gate_logits:
        p = F.softmax(logits, dim=-1)
        counts = counts + torch.bincount(torch.topk(p, top_k, dim=-1).indices.reshape(-1), minlength=num_experts)
        probs = probs + p.sum(dim=0)
    rows = sum(len(logits) for logits in gate_logits)
    return torch.sum(counts / rows * (probs / rows)) * num_experts
