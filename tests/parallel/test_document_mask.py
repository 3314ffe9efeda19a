"""data.attention = document: attention causal within each document only. Loss and every gradient
(float64) equal a reference that runs each document separately through the serial model (at the
document's global positions, which the mask keeps), on 1 rank, on x2 y2 z2, on pp2, and with
context parallelism (cp2, cp4, cp2 x2 y2, pp2 cp2), with windows holding 1 to 8 documents, the last
one cut at the window's edge, documents longer than a cp chunk and shorter. Ring attention with
document ids equals the 1-rank masked attention, its skipped blocks included. Held-out evaluation
(`train.evaluate`, `fourfold eval --attention`) masks documents too."""

import argparse
import json

import numpy as np
import pytest
import torch

from families_on_grids import serial_grads
from fourfold.config import ConfigError
from fourfold.models.config import ModelConfig
from fourfold.parallel import comm, context
from fourfold.parallel.grid import Grid
from fourfold.parallel.model import Model, local_batch
from fourfold.parallel.pipeline import Pipeline
from fourfold.parallel.tensor.block import TensorOptions, document_ids, masked_attention
from fourfold.parallel.tensor.params import full_weights
from fourfold.parallel.transformer import Transformer
from fourfold.spec.job import Job
from fourfold.spec.layout import Layout
from fourfold.spec.rules import problems
from fourfold.train.evaluate import evaluate, windows

LLAMA = ModelConfig("llama", hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, max_positions=32,
                    tied=False, eps=1e-5)
GPT = ModelConfig("gpt2", hidden=32, layers=2, heads=4, kv_heads=4, ffn=64, vocab=64, max_positions=32,
                  tied=True, eps=1e-5)
BATCH, SEQ, EOS = 8, 16, 0


def _batch() -> torch.Tensor:
    """[8, SEQ + 1] ids: row r holds r + 1 documents (end-of-document ids at random places, the last
    document cut at the window's edge), no end-of-document id elsewhere."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, LLAMA.vocab, (BATCH, SEQ + 1), generator=g)
    for r in range(BATCH):
        ends = torch.randperm(SEQ - 1, generator=g)[:r]  # r ends within the inputs, none at the last input
        ids[r, ends] = EOS
    return ids


def _documents(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of each document of the inputs ids[:, :-1]."""
    docs = document_ids(ids[:, :-1], EOS)
    out = []
    for r in range(len(ids)):
        for d in docs[r].unique().tolist():
            where = (docs[r] == d).nonzero().flatten()
            out.append((r, where[0].item(), where[-1].item() + 1))
    return out


def _reference(cfg, ids):
    """The loss and gradients of each document run alone through the serial model, at its positions."""
    model = Transformer(Grid(Layout()), cfg, TensorOptions(dtype=torch.float64), seed=5, std=0.3)
    scale = 1.0 / ids[:, 1:].numel()
    total = 0.0
    for r, a, b in _documents(ids):
        loss = model(ids[r : r + 1, a:b], ids[r : r + 1, a + 1 : b + 1], positions=torch.arange(a, b)).sum() * scale
        loss.backward()
        total += loss.item()
    return total, full_weights(model, grads=True)


def _parallel(cfg, ids, sizes, microbatches=1, recompute="none"):
    layout = Layout(**sizes)
    grid = Grid(layout)
    opts = TensorOptions(dtype=torch.float64)
    rows = BATCH // layout.dp
    job = Job(layout, global_batch=BATCH, micro_batch=rows // microbatches, seq=SEQ)
    local = ids.chunk(layout.dp)[grid.coords["dp"]].numpy()
    inputs, targets, documents = local_batch(job, grid, local, EOS)
    scale = 1.0 / ids[:, 1:].numel()
    if layout.pp > 1:
        pipe = Pipeline(grid, cfg, opts, microbatches=microbatches, micro_batch=rows // (layout.z * microbatches),
                        seq=SEQ // layout.cp, seed=5, std=0.3, recompute=recompute)
        models = pipe.models
        loss = pipe.step(inputs, targets, documents, scale=scale)
    else:
        models = [Transformer(grid, cfg, opts, seed=5, std=0.3, recompute=recompute)]
        loss = models[0](inputs, targets, documents).sum() * scale
        loss.backward()
    grads = serial_grads(models, grid)
    loss = comm.all_reduce(loss.detach(), grid.group(("dp", "pp", "cp", "z"))).item()
    return loss, grads


def _check(results, reference):
    ref_loss, ref_grads = reference
    grads = {}
    for loss, g in results:
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-10, (loss, ref_loss)
        grads.update(g)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        if name.endswith("attn.k.bias"):  # GPT-2's: an exactly-zero gradient (softmax ignores a shift), rounding noise
            assert grads[name].abs().max() < 1e-12, name
            continue
        err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-10, (name, err)


def test_document_ids_and_batch():
    ids = _batch()
    assert [sum(r2 == r for r2, _, _ in _documents(ids)) for r in range(BATCH)] == list(range(1, 9))
    docs = document_ids(torch.tensor([[5, 0, 3, 0, 0, 7]]), 0)
    assert docs.tolist() == [[0, 0, 1, 1, 2, 3]]  # an end-of-document id closes its document


def _references(ids):
    """Each family's reference, and the llama's loss with plain causal attention."""
    model = Transformer(Grid(Layout()), LLAMA, TensorOptions(dtype=torch.float64), seed=5, std=0.3)
    causal = (model(ids[:, :-1], ids[:, 1:]).sum() / ids[:, 1:].numel()).item()
    return {cfg.family: _reference(cfg, ids) for cfg in (LLAMA, GPT)}, causal


@pytest.fixture(scope="module")
def references(ranks):
    ids = _batch()
    ref, causal = ranks.run(_references, 1, ids)[0]
    assert abs(causal - ref["llama"][0]) > 1e-6  # the mask changes something
    return ids, ref


def test_masks_documents_serial(ranks, references):
    ids, ref = references
    for cfg in (LLAMA, GPT):
        _check(ranks.run(_parallel, 1, cfg, ids, {}), ref[cfg.family])


def test_masks_documents_3d(ranks, references):
    ids, ref = references
    for cfg in (LLAMA, GPT):
        _check(ranks.run(_parallel, 8, cfg, ids, dict(x=2, y=2, z=2)), ref[cfg.family])


def test_masks_documents_pipeline(ranks, references):
    ids, ref = references
    _check(ranks.run(_parallel, 4, LLAMA, ids, dict(pp=2, dp=2), 2, "selective"), ref["llama"])
    _check(ranks.run(_parallel, 4, LLAMA, ids, dict(pp=2, x=2), 2, "full"), ref["llama"])


def test_masks_documents_context_parallel(ranks, references):
    """cp2 and cp4 (chunks of 4 and 2 tokens: the one-document row spans every chunk, the eight-
    document rows have documents within one chunk), cp with x and y, and cp with pp."""
    ids, ref = references
    for cfg in (LLAMA, GPT):
        _check(ranks.run(_parallel, 2, cfg, ids, dict(cp=2)), ref[cfg.family])
        _check(ranks.run(_parallel, 4, cfg, ids, dict(cp=4)), ref[cfg.family])
    _check(ranks.run(_parallel, 8, LLAMA, ids, dict(cp=2, x=2, y=2)), ref["llama"])
    _check(ranks.run(_parallel, 4, GPT, ids, dict(pp=2, cp=2), 2, "selective"), ref["gpt2"])


def _ring_documents(cp: int, layouts: list[torch.Tensor]):
    """(largest error of output, dQ, dK, dV of the ring and of `masked_attention` against SDPA with
    the whole mask over every layout, the ring steps each layout skipped on this rank, the (rows x
    keys) the ring attended off the own block)."""
    group = Grid(Layout(cp=cp)).group("cp")
    g = torch.Generator().manual_seed(3)
    errors, skipped, area = [], [], []
    for documents in layouts:
        b, s = documents.shape
        q = torch.randn(b, 4, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(b, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
        grad = torch.randn(b, 4, s, 8, generator=g, dtype=torch.float64)
        mask = (documents[:, :, None] == documents[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        expected.backward(grad)
        local = [context.shard_sequence(t.detach(), group, dim=2).requires_grad_() for t in (q, k, v)]
        mine = context.shard_sequence(documents, group)
        out = context.ring_attention(*local, group, mine)
        out.backward(context.shard_sequence(grad, group, dim=2))
        errors.append((out - context.shard_sequence(expected.detach(), group, 2)).abs().max().item())
        errors += [(t.grad - context.shard_sequence(full.grad, group, 2)).abs().max().item()
                   for t, full in zip(local, (q, k, v))]
        banded = [t.detach().requires_grad_() for t in (q, k, v)]  # the 1-rank path, in bands
        out = masked_attention(*banded, documents, enable_gqa=True)
        out.backward(grad)
        errors.append((out - expected).abs().max().item())
        errors += [(t.grad - full.grad).abs().max().item() for t, full in zip(banded, (q, k, v))]
        plan = context.Documents(mine).ring(group, mine.shape[1], 0, mine.device)
        skipped.append(plan.count(None))
        area.append(sum((r.stop - r.start) * (k.stop - k.start) for p in plan[1:] if p for r, k in p.cut))
    with pytest.raises(ValueError, match="must not decrease"):
        context.ring_attention(*local, group, mine.flip(1))
    return max(errors), skipped, area


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_with_documents(ranks, cp):
    """Against SDPA with the whole [s, s] mask (float64, GQA): one document per row beside many; a
    document per cp chunk (every other rank's block skipped); documents of 3 tokens (some skipped,
    the others cut to the rows and keys sharing a document); one long document then short ones.
    Ids that decrease are refused."""
    s, chunk = 32, 32 // (2 * cp)
    position = torch.arange(s)
    layouts = [torch.stack([torch.zeros(s, dtype=torch.long), position // 5]), (position // chunk)[None],
               (position // 3)[None], torch.where(position < 20, 0, position - 19)[None]]
    results = ranks.run(_ring_documents, cp, cp, layouts)
    assert max(r[0] for r in results) < 1e-12
    skipped = [sum(r[1][i] for r in results) for i in range(len(layouts))]
    assert skipped[0] == 0 and skipped[1] == cp * (cp - 1) and 0 < skipped[2] < cp * (cp - 1), skipped
    area = [sum(r[2][i] for r in results) for i in range(len(layouts))]
    uncut = cp * (cp - 1) * chunk * 2 * chunk  # each off-own step: s rows x s/2 keys, or s/2 rows x s keys
    assert area[0] == uncut and area[1] == 0 and 0 < area[2] < uncut / 4, (area, uncut)


def _masked_block(g: torch.Generator):
    """A GQA block (4 query heads, 2 kv heads, 6 rows, 5 keys) in float64 under a random mask whose
    row 0 sees no key and row 1 every key."""
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64) for _ in "kv")
    mask = torch.rand(2, 6, 5, generator=g) < 0.5
    mask[:, 0] = False
    mask[:, 1] = True
    return q, k, v, mask


def test_masked_block_on_cpu_and_elsewhere():
    """The CPU kernel with an additive mask and the explicit scores (CUDA's path) agree, rows seeing
    no key included: their output merges as nothing, and the backward (given the final log-sum-
    exp, finite) gives them no gradient."""
    g = torch.Generator().manual_seed(4)
    q, k, v, mask = _masked_block(g)
    out, lse = context.attend_block_masked(q, k, v, mask, 0.3)
    out_m, lse_m = context._masked_math(q, k, v, mask, 0.3)
    seen = mask.any(-1)[:, None].expand_as(lse)
    assert (out - out_m)[seen].abs().max() < 1e-14 and (lse - lse_m)[seen].abs().max() < 1e-14
    assert torch.isinf(lse_m[~seen]).all() and (lse[~seen] < -1e300).all()
    final = torch.where(seen, lse_m, 0.0)  # as after merging with a block they see
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = context.attend_block_masked_backward(dout, q, k, v, out_m, final, mask, 0.3)
    grads_m = context._masked_math_backward(dout, q, k, v, out_m, final, mask, 0.3)
    for a, b in zip(grads, grads_m):
        assert (a - b).abs().max() < 1e-13
    assert grads[0][:, :, 0].abs().max() == 0  # the row that sees nothing


def _efficient_reference(q, k, v, bias, scale):
    """CUDA's memory-efficient kernel as its contract reads (torch's meta registration and its CUDA
    source): one head of K/V a query head, a bias of q's dtype whose rows start at 16-element
    boundaries, the log-sum-exp padded to 32 rows (+inf in the pad). A row whose bias is the dtype's
    lowest number everywhere gets output 0 and log-sum-exp 0: the kernel scales the bias by log2(e),
    past fp32's range for bf16, and resets a row whose maximum is -inf."""
    assert k.shape[1] == q.shape[1] and bias.shape == (*q.shape[:3], k.shape[2]) and bias.dtype == q.dtype
    assert bias.stride(-2) % context.BIAS_ALIGNMENT == 0 and bias.stride(-1) == 1
    s = q @ k.transpose(-1, -2) * scale + bias
    lse = s.logsumexp(-1)
    out = torch.softmax(s, -1) @ v
    unseen = (bias == torch.finfo(bias.dtype).min).all(-1)
    lse, out = lse.masked_fill(unseen, 0.0), out.masked_fill(unseen[..., None], 0.0)
    padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("inf"), dtype=torch.float64)
    padded[..., :lse.shape[2]] = lse
    return out, padded


def _efficient_backward_reference(dout, q, k, v, bias, out, lse, scale):
    assert lse.shape[-1] % context.LSE_ALIGNMENT == 0 and k.shape[1] == q.shape[1]
    p = torch.exp(q @ k.transpose(-1, -2) * scale + bias - lse[..., :q.shape[2], None])
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dout


def test_masked_block_on_the_efficient_kernel(monkeypatch):
    """The ring's masked blocks on CUDA: the memory-efficient kernel with the mask as a bias, GQA's
    K/V repeated and their gradients summed back, the log-sum-exp unpadded and padded again. With
    the kernel's contract run on CPU (`_efficient_reference`), equal to the explicit scores in
    float64, rows seeing no key included (they merge as nothing and get no gradient)."""
    monkeypatch.setattr(context, "efficient_forward", _efficient_reference)
    monkeypatch.setattr(context, "efficient_backward", _efficient_backward_reference)
    g = torch.Generator().manual_seed(5)
    q, k, v, mask = _masked_block(g)
    out, lse = context._masked_efficient(q, k, v, mask, 0.3)
    out_m, lse_m = context._masked_math(q, k, v, mask, 0.3)
    seen = mask.any(-1)[:, None].expand_as(lse)
    assert lse.shape == lse_m.shape and lse.is_contiguous()
    assert (out - out_m)[seen].abs().max() < 1e-14 and (lse - lse_m)[seen].abs().max() < 1e-14
    assert torch.equal(lse[~seen], lse_m[~seen]) and torch.isinf(lse[~seen]).all()  # -inf, as the kernel's 0 is not
    merged_out, merged_lse = torch.ones_like(out), torch.zeros_like(lse)
    context._merge(merged_out, merged_lse, out, lse)  # a row that sees nothing leaves what it merges into
    assert (merged_out[:, :, 0] == 1).all() and (merged_lse[:, :, 0] == 0).all()
    final = torch.where(seen, lse_m, 0.0)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = context._masked_efficient_backward(dout, q, k, v, out_m, final, mask, 0.3)
    grads_m = context._masked_math_backward(dout, q, k, v, out_m, final, mask, 0.3)
    for a, b in zip(grads, grads_m):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-13
    assert grads[0][:, :, 0].abs().max() == 0


def test_preferred_kernels_put_cudnn_first_and_keep_what_the_caller_turned_off():
    """`context.preferred_kernels` (entered by `Model.step` on GPUs): SDPA's priority cuDNN, then flash;
    inside an enclosing sdpa_kernel(FLASH_ATTENTION) only flash stays on; the previous state after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = torch._C._get_sdp_priority_order()
    with context.preferred_kernels():
        order = torch._C._get_sdp_priority_order()
        assert order[:2] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)]
        assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context.preferred_kernels():
        assert torch.backends.cuda.flash_sdp_enabled()
        assert not (torch.backends.cuda.cudnn_sdp_enabled() or torch.backends.cuda.math_sdp_enabled()
                    or torch.backends.cuda.mem_efficient_sdp_enabled())
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch._C._get_sdp_priority_order() == before
    with sdpa_kernel(SDPBackend.MATH), context.preferred_kernels():  # (sdpa_kernel alone would keep math first)
        pass
    assert torch._C._get_sdp_priority_order() == before


def _flash_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, enable_gqa=False,
                            window_size=(-1, -1)):
    """torch's varlen_attn as its contract reads, on CPU: packed [tokens, heads, d] rows, int32
    cumulative starts, and flash-attn's window: query i sees keys i - left .. i + right inclusive
    (-1: no bound)."""
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int(cu_seq_q.diff().max()) and (enable_gqa or key.shape[1] == query.shape[1])
    left, right = window_size
    out = []
    for a, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        i = torch.arange(e - a)
        distance = i[:, None] - i[None, :]
        seen = (distance >= -right if right >= 0 else True) & (distance <= left if left >= 0 else True)
        q, k, v = (t[a:e].transpose(0, 1) for t in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(out)


def test_the_efficient_kernels_calls_bind_to_torchs_operators():
    """The real aten calls of the masked blocks' CUDA path, on meta tensors (torch's shape rules):
    the arguments bind to the operators' schemas and the shapes are the flash path's."""
    q = torch.empty(2, 8, 40, 64, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(2, 2, 24, 64, device="meta", dtype=torch.bfloat16) for _ in "kv")
    mask = torch.ones(2, 40, 24, device="meta", dtype=torch.bool)
    out, lse = context._masked_efficient(q, k, v, mask, 0.125)
    grads = context._masked_efficient_backward(torch.empty_like(out), q, k, v, out, lse, mask, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 40) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_document_ids_as_varlen_sequences():
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    starts, longest = context.Documents(ids).varlen(2, 5, torch.device("cpu"))
    assert starts.tolist() == [0, 2, 5, 6, 8, 10] and starts.dtype == torch.int32 and longest == 3
    starts, longest = context.Documents(torch.zeros(2, 3, dtype=torch.long)).varlen(2, 3, torch.device("cpu"))
    assert starts.tolist() == [0, 3, 6] and longest == 3  # a sequence's first token starts a document
    starts, longest = context.Documents(None).varlen(2, 5, torch.device("cpu"))
    assert starts.tolist() == [0, 5, 10] and longest == 5
    with pytest.raises(ValueError, match="must not decrease"):
        context.Documents(torch.tensor([[0, 1, 0]])).varlen(1, 3, torch.device("cpu"))


@pytest.mark.parametrize("window", [0, 5])
def test_masked_attention_on_varlen_equals_the_banded_path(monkeypatch, window):
    """CUDA's path: flash's varlen kernel, each document a sequence and the window its left window,
    GQA native. With the kernel's contract run on CPU (`_flash_varlen_reference`), equal to the
    banded SDPA path in float64, forward and backward, with documents, a window, or both."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _flash_varlen_reference)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 8, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    for ids in (torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 12 + [2] * 9]), None):
        if ids is None and not window:
            continue
        results = []
        for use_varlen in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = masked_attention(*leaves, ids, window, enable_gqa=True, varlen=use_varlen)
            out.backward(dout)
            results.append([out.detach(), *(t.grad for t in leaves)])
        for a, b in zip(*results):
            assert (a - b).abs().max() < 1e-13


def test_rules_accept_context_parallelism():
    job = Job(Layout(cp=2), global_batch=8, micro_batch=8, seq=16)
    assert problems(LLAMA, job, world=2, attention="document") == problems(LLAMA, job, world=2) == []


def _eval_tokens() -> np.ndarray:
    """Five windows of SEQ + 1 tokens (overlapping by one) holding 1 to 4 documents each."""
    g = torch.Generator().manual_seed(12)
    tokens = torch.randint(1, LLAMA.vocab, (5 * SEQ + 1,), generator=g)
    tokens[[3, 20, 25, 27, 44, 60, 61, 70]] = EOS
    return tokens.numpy()


def _eval_reference(tokens):
    ids = torch.from_numpy(windows(tokens, SEQ, range(5)))
    return _reference(LLAMA, ids)[0]


def _evaluate(sizes, tokens):
    """The held-out loss with document masking, and without, two windows per step (the last padded)."""
    layout = Layout(**sizes)
    job = Job(layout, micro_batch=2 * layout.z, global_batch=2 * layout.z * layout.dp, seq=SEQ, schedule="gpipe")
    model = Model(Grid(layout), job, LLAMA, dtype=torch.float64, seed=5, std=0.3)
    return [evaluate(model, tokens, SEQ, 2, end_of_document=e)["loss"] for e in (EOS, None)]


def test_evaluation_masks_documents(ranks):
    tokens = _eval_tokens()
    ref = ranks.run(_eval_reference, 1, tokens)[0]
    for n, sizes in ((1, {}), (2, dict(cp=2)), (4, dict(pp=2, cp=2))):
        for masked, causal in ranks.run(_evaluate, n, sizes, tokens):
            assert abs(masked - ref) / ref < 1e-10 and abs(causal - masked) > 1e-6, (sizes, masked, causal, ref)


def test_eval_command_finds_the_end_of_document(tmp_path):
    """`fourfold eval --attention document` ends documents at the model tokenizer's end-of-document id;
    a training checkpoint's data.attention is the default; no tokenizer names the fix."""
    from tokenizers import Tokenizer, models

    from fourfold.cli.eval import _end_of_document

    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "<|endoftext|>": 2}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json"))
    (tmp_path / "meta.json").write_text(json.dumps({"config": {"data": {"attention": "document"}}}))

    def args(**kw):
        return argparse.Namespace(**{"hf": None, "checkpoint": None, "attention": None, **kw})

    assert _end_of_document(args(hf=str(tmp_path), attention="document")) == 2
    assert _end_of_document(args(hf=str(tmp_path))) is None
    assert _end_of_document(args(checkpoint=str(tmp_path))) == 2  # as it was trained
    assert _end_of_document(args(checkpoint=str(tmp_path), attention="causal")) is None
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json: put the model's tokenizer.json there, or give "
                                          "--attention causal"):
        _end_of_document(args(hf=str(tmp_path), attention="document"))


def test_masked_attention_with_heads_expanded_equals_gqa():
    """CUDA's path (`expand_heads`: K/V repeated to the query heads, so its memory-efficient kernel
    takes the mask; with GQA and a mask SDPA falls to math) against CPU's, with documents and a
    window, forward and backward, float64."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 8, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64) for _ in "kv")
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 21])
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    results = []
    for expand in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = masked_attention(*leaves, ids, 5, enable_gqa=True, expand_heads=expand)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert (a - b).abs().max() < 1e-13
