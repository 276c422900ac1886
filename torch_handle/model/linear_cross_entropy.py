"""The output layer and the loss in one, a chunk of tokens at a time: no (tokens x vocabulary) tensor exists at once.

* ``linear_cross_entropy`` -- token-mean cross-entropy of ``hidden @ weight.T`` (with label smoothing and an ignore
  index), computed by ``ChunkedLinearCrossEntropy``: each chunk's logits are projected, reduced to the loss and
  turned into the chunk's gradients in the forward pass, then dropped (Liger Kernel's ``FusedLinearCrossEntropy``,
  ``liger_kernel/ops/fused_linear_cross_entropy.py``; the same arithmetic as the whole logits' loss, so the
  same FLOPs: one projection forward, two matmuls for the gradients).
* ``sequence_logps`` -- per-sequence summed log-probabilities of the labels (what preference losses such as DPO
  need), computed by ``ChunkedSequenceLogProbs``: forward keeps only the inputs and one log-sum-exp per token,
  backward recomputes each chunk's logits (torchtune's chunked cross-entropy recomputes the same way; Apple's Cut
  Cross-Entropy, Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models", keeps them on chip).

Why: at Llama 3's vocabulary (128,256) and 2,048 tokens the fp32 logits alone are 1.05 GB a sequence, again for
their gradient, plus the 16-bit copy the output layer writes under autocast. Here the working set is one chunk's
logits and their gradient (``chunk_rows`` rows: at most 256 MiB of fp32 on CUDA and a quarter of the whole logits)
plus the output weight's fp32 gradient, which the full path also makes and the step keeps; the weight's copy in the
compute dtype only where it is small beside the logits (``cast_whole``), else one block of it at a time. Measured in
docs/performance.md (``benchmarks/loss_memory.py``).

Precision: the chunk's logits are computed in the compute dtype (autocast's, else the hidden states'), exactly as
``nn.Linear`` under autocast rounds them, then upcast to fp32 for the log-sum-exp; the gradients go back through the
same dtype; the output weight's gradient is accumulated over the chunks in fp32; where the weight is read a block
at a time, the hidden states' gradient is summed over the blocks in fp32, each block's product rounded to the
compute dtype first (one product rounds once on the full path: within bf16's tolerance). In fp32 the values equal the
whole-logits loss (``torch_handle.model.kernels.cross_entropy``) to rounding order (tests/unit/test_chunked_loss.py).

Shape letters: N tokens (B·T flattened), C = d_model, V vocabulary, B batch, T sequence length. Only ``torch``
is imported.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 24}
"""The most logit elements a chunk holds by device type (``chunk_rows``): 256 MiB of fp32 on CUDA (523 rows of Llama
3's 128,256 vocabulary), 64 MiB on CPU; other devices take CUDA's. Every chunk reads the whole weight twice and reads
and writes its fp32 gradient (about 14 bytes per weight element in bf16), so fewer, larger chunks keep the matmuls
compute bound: at 16 rows a chunk the CPU loss path took 3.1x the full one's time (``benchmarks/loss_memory.py``,
on a shared machine)."""
MIN_CHUNK_ROWS = 128
"""No chunk is smaller than this (unless the input is), whatever the vocabulary."""
LOGITS_SHARE = 4
"""A chunk holds at most 1/4 of the whole (N, V) logits: at least four chunks, so the working set is a fraction of
what the full path makes at any N (B·T). Without it a short input was one chunk: at 2,048 tokens of a 32,000
vocabulary the chunk was every token, and the loss path's peak 0.88x the full one's (docs/performance.md)."""
COPY_SHARE = 8
"""The output weight is cast to the compute dtype once, whole, only where that copy (V x C x 2 bytes in bf16) is at
most 1/8 of the fp32 logits' bytes (N x V x 4: N >= 4C at bf16); else each chunk casts one block of ``weight_rows``
rows at a time. At B·T = d_model (2,048 tokens of Llama 3.2 1B) a whole bf16 copy is half the fp32 logits and was
half the chunked path's transient memory (0.41x the full path's where the target is 0.25x)."""


def chunk_rows(n_rows: int, vocab: int, device: torch.device | str = "cpu") -> int:
    """Rows (tokens) per chunk of ``n_rows`` over ``vocab``: ``CHUNK_ELEMENTS`` of the device over ``vocab``, and
    at most 1/``LOGITS_SHARE`` of ``n_rows``; at least ``MIN_CHUNK_ROWS``, at most ``n_rows`` (and at least 1)."""
    kind = torch.device(device).type
    budget = CHUNK_ELEMENTS[kind if kind in CHUNK_ELEMENTS else "cuda"] // max(1, vocab)
    return max(1, min(n_rows, max(MIN_CHUNK_ROWS, min(budget, -(-n_rows // LOGITS_SHARE)))))


def weight_rows(vocab: int, width: int, device: torch.device | str = "cpu") -> int:
    """Rows of the (V, C) output weight per block (its gradient's accumulation; its cast where not whole): a quarter
    of a chunk's elements (``CHUNK_ELEMENTS`` / 4 / C), at most V."""
    kind = torch.device(device).type
    budget = CHUNK_ELEMENTS[kind if kind in CHUNK_ELEMENTS else "cuda"]
    return max(1, min(vocab, budget // (4 * max(1, width))))


def cast_whole(n_rows: int, weight: Tensor, dtype: torch.dtype) -> bool:
    """Whether the chunked loss casts ``weight`` (V, C) to ``dtype`` once (``COPY_SHARE``) rather than a block per
    chunk; True where no cast is needed (``weight`` already in ``dtype``: no copy either way)."""
    if weight.dtype == dtype:
        return True
    return weight.numel() * dtype.itemsize * COPY_SHARE <= n_rows * weight.shape[0] * 4


_ADDMM_FP32: dict[str, bool] = {}
"""Per device type, whether ``torch.addmm(acc, a, b, torch.float32, out=acc)`` accumulates a 16-bit product into an
fp32 ``acc`` in place there (tried once: ``accumulates_in_fp32``)."""


def _addmm_fp32_works(device: torch.device) -> bool:
    """Whether the fp32-output addmm runs on ``device`` and adds in place: ones (2, 2) fp32 += ones (2, 2) bf16 ·
    ones (2, 2) bf16 must give 3 everywhere (one host read, once per device type)."""
    try:
        acc = torch.ones(2, 2, device=device)
        one = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        torch.addmm(acc, one, one, torch.float32, out=acc)
        return bool((acc == 3).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def accumulates_in_fp32(g: Tensor, grad_w: Tensor) -> bool:
    """Whether the output weight's fp32 gradient ``grad_w`` can take gᵀ · h inside the matmul (``torch.addmm(...,
    out_dtype=torch.float32)``, cuBLAS accumulating the 16-bit inputs into fp32 output): ``g`` in bf16 or fp16,
    ``grad_w`` fp32, and a device whose kernel exists and adds in place (torch 2.13: CUDA only; the CPU has none and
    keeps the blocked path). No (V, C) or (rows, C) 16-bit product is written and read back and no separate fp32
    add: about 12 bytes less traffic per weight element per chunk (docs/performance.md). Decided once per device
    type (``_ADDMM_FP32``); under ``torch.compile`` only what was decided eagerly (else False)."""
    if grad_w.dtype != torch.float32 or g.dtype not in (torch.bfloat16, torch.float16):
        return False
    kind = g.device.type
    if kind not in _ADDMM_FP32 and not torch.compiler.is_compiling():
        _ADDMM_FP32[kind] = kind == "cuda" and _addmm_fp32_works(g.device)
    return _ADDMM_FP32.get(kind, False)


def compute_dtype(hidden: Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute ``hidden``'s logits in: autocast's where it is on for ``hidden``'s
    device, else ``hidden``'s own."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


class _Weight:
    """The output weight (V, C) as the chunked loss reads it in ``dtype``: whole (one cast, or none) or a block of
    ``rows`` rows at a time, cast when read (``cast_whole``)."""

    def __init__(self, weight: Tensor, dtype: torch.dtype, whole: bool, rows: int) -> None:
        self.dtype, self.rows = dtype, rows
        self.whole = weight.to(dtype) if whole else None  # (V, C) in dtype, or None: blocks of weight
        self.weight = weight

    def logits(self, h_c: Tensor) -> Tensor:
        """(r, V) fp32: h_c (r, C) @ Wᵀ computed in ``dtype`` (rounded as ``nn.Linear`` rounds it), then fp32."""
        if self.whole is not None:
            return (h_c @ self.whole.T).float()
        z = torch.empty(h_c.shape[0], self.weight.shape[0], dtype=torch.float32, device=h_c.device)  # (r, V)
        for s in range(0, self.weight.shape[0], self.rows):
            z[:, s:s + self.rows] = h_c @ self.weight[s:s + self.rows].to(self.dtype).T  # (r, rows)
        return z

    def grads(self, g: Tensor, h_c: Tensor, grad_h: Tensor | None, grad_w: Tensor | None) -> None:
        """The chunk's gradients from g = d loss / d z (r, V) in ``dtype``: grad_h (r, C) = g · W written, grad_w
        (V, C) fp32 += gᵀ · h_c in one matmul with fp32 output where the device has it (``accumulates_in_fp32``),
        else a block of ``rows`` rows at a time (each block's (rows, C) product the only temporary: a (V, C)
        product in bf16 would be half the fp32 gradient again)."""
        if grad_w is not None and accumulates_in_fp32(g, grad_w):
            torch.addmm(grad_w, g.T, h_c, torch.float32, out=grad_w)  # (V, C) fp32 += gᵀ · h_c, no 16-bit product
            grad_w = None
        if self.whole is not None and grad_h is not None:
            grad_h.copy_(g @ self.whole)  # (r, C)
        if self.whole is not None and (grad_w is None or grad_w.dtype == g.dtype):
            if grad_w is not None:
                grad_w.addmm_(g.T, h_c)
            return
        acc = None
        if self.whole is None and grad_h is not None:  # Σ over blocks of g_b · W_b, summed in fp32
            acc = torch.zeros(g.shape[0], self.weight.shape[1], dtype=torch.float32, device=g.device)  # (r, C)
        for s in range(0, self.weight.shape[0], self.rows):
            g_b = g[:, s:s + self.rows]  # (r, rows)
            if acc is not None:
                acc += g_b @ self.weight[s:s + self.rows].to(self.dtype)  # (r, C)
            if grad_w is not None:
                grad_w[s:s + self.rows].add_(g_b.T @ h_c)  # (rows, C)
        if acc is not None:
            grad_h.copy_(acc)


def _softmax_(z: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(z) along the last dimension written into z (fp32 (r, V)), and the log-sum-exp (r,): max, exp in
    place, sum (``torch.logsumexp`` and ``torch.softmax`` would each allocate another (r, V))."""
    top = z.amax(dim=-1, keepdim=True)  # (r, 1)
    total = z.sub_(top).exp_().sum(dim=-1, keepdim=True)  # (r, 1)
    return z.div_(total), (top + total.log()).squeeze(1)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Token-mean cross-entropy of the logits ``hidden @ weight.T``, ``rows`` tokens at a time, with the gradients
    computed in the forward pass chunk by chunk (Liger Kernel's ``FusedLinearCrossEntropy``).

    Per chunk: z = h_c · Wᵀ (rows, V) in ``dtype``; in fp32 lse = log Σ exp z; the row's loss (1 - eps)(lse - z_y) +
    eps(lse - mean_j z_j) (label smoothing as ``F.cross_entropy(label_smoothing=eps)``); then the gradient of the
    token-mean loss with respect to z, (softmax(z) - q) · valid / n (q the smoothed target, n the counted tokens),
    rounded to ``dtype``, gives the chunk's d h = g · W and adds gᵀ · h_c to d W (fp32). Backward only scales them
    by the incoming gradient (in place: backward runs once; a second backward through it raises RuntimeError).

    forward(hidden (N, C), weight (V, C), labels (N,) long, eps float in [0, 1), ignore_index int, rows int, dtype
    torch.dtype, need_hidden bool, need_weight bool) -> scalar fp32 mean over labels != ignore_index (NaN when
    none, like ``F.cross_entropy``). ``need_*`` False: that gradient is not computed (a frozen output weight under
    LoRA/QLoRA; evaluation under ``no_grad``, where neither is).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, eps: float, ignore_index: int, rows: int,
                dtype: torch.dtype, need_hidden: bool, need_weight: bool) -> Tensor:
        h = hidden.to(dtype)  # (N, C): one cast, as autocast's linear makes
        n_rows, vocab = h.shape[0], weight.shape[0]
        w = _Weight(weight, dtype, cast_whole(n_rows, weight, dtype), weight_rows(vocab, weight.shape[1], h.device))
        valid = labels != ignore_index  # (N,)
        safe = torch.where(valid, labels, 0)[:, None]  # (N, 1): ignored rows point at class 0, then weigh 0
        n = valid.sum()
        row_weight = valid / n.clamp(min=1)  # (N,) fp32: d loss / d row loss (0, not 0/0, when none counts)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(hidden) if need_hidden else None  # (N, C)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_weight else None  # (V, C)
        for s in range(0, n_rows, rows):
            h_c, idx = h[s:s + rows], safe[s:s + rows]
            z = w.logits(h_c)  # (r, V) fp32: rounded to dtype as nn.Linear rounds
            z_label, z_mean = z.gather(1, idx).squeeze(1), z.mean(dim=-1) if eps else None  # (r,), (r,)
            p, lse = _softmax_(z)  # (r, V) in place of the logits, (r,): no second (r, V) buffer
            row = lse - z_label  # (r,): -log p_label
            if eps:
                row = row.mul_(1.0 - eps).add_(lse - z_mean, alpha=eps)
            total += row.masked_fill_(~valid[s:s + rows], 0.0).sum()
            if grad_h is None and grad_w is None:
                continue
            if eps:
                p.sub_(eps / vocab)
            p.scatter_add_(1, idx, torch.full_like(idx, eps - 1.0, dtype=p.dtype))
            g = p.mul_(row_weight[s:s + rows, None]).to(dtype)  # (r, V): d loss / d z, in the compute dtype
            del z, p
            w.grads(g, h_c, None if grad_h is None else grad_h[s:s + rows], grad_w)
            del g  # before the next chunk's: the name would hold this one while that one is made
        ctx.grads = [grad_h, grad_w]
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.grads is None:
            raise RuntimeError("ChunkedLinearCrossEntropy: backward through it twice (its gradients were computed "
                               "in forward and handed over once)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h = grad_h.mul_(grad.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, label_smoothing: float = 0.0,
                         ignore_index: int = -100, *, rows: int | None = None) -> Tensor:
    """Token-mean cross-entropy in fp32 of the logits ``hidden @ weight.T``, exactly ``F.cross_entropy(
    (hidden @ weight.T).float(), labels, ignore_index=..., label_smoothing=...)`` (the matmul in autocast's dtype
    where autocast is on) without the (N, V) logits: ``ChunkedLinearCrossEntropy``.

    Args:
        hidden: (..., C) float, the final (normalised) hidden states; flattened to (N, C).
        weight: (V, C) float, the output layer's weight (a tied embedding's table); frozen or not.
        labels: (...,) long, ``hidden``'s leading shape; ``ignore_index`` entries are left out of the mean.
        label_smoothing: eps in [0, 1) (Szegedy et al. 2016; Vaswani et al. 2017, eps = 0.1).
        rows: tokens per chunk (default ``chunk_rows``).

    Returns:
        Scalar fp32; NaN when every label is ignored.

    Raises:
        ValueError: ``labels``' shape is not ``hidden``'s leading shape, or the widths of ``hidden`` and ``weight``
            differ.
    """
    if labels.shape != hidden.shape[:-1] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"labels {tuple(labels.shape)} do not fit ((..., C), (V, C), (...))")
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)  # (N, C), (N,)
    grad = torch.is_grad_enabled()
    rows = rows or chunk_rows(flat.shape[0], weight.shape[0], flat.device)
    return ChunkedLinearCrossEntropy.apply(flat, weight, targets, float(label_smoothing), ignore_index, rows,
                                           compute_dtype(hidden), grad and flat.requires_grad,
                                           grad and weight.requires_grad)


class WholeVocab:
    """Where ``ChunkedSequenceLogProbs`` finds the vocabulary: all of it in this process's (V, C) weight. The
    vocabulary-parallel counterpart (each rank a slice, the log-sum-exp across the group) is
    :class:`~torch_handle.model.linear_cross_entropy_tp.VocabSlice`."""

    def owned(self, labels: Tensor, valid: Tensor, n_local: int) -> tuple[Tensor, Tensor]:
        """(idx (N, 1), mine (N,) bool): each counted label's column in the local logits and whether this process
        holds it (every counted one here); ignored rows point at column 0."""
        return torch.where(valid, labels, 0)[:, None], valid

    def lse_logp(self, z: Tensor, idx: Tensor, mine: Tensor) -> tuple[Tensor, Tensor]:
        """(log-sum-exp (r,), log p of the label (r,)) of a chunk's fp32 logits z (r, V), which it overwrites."""
        z_label = z.gather(1, idx).squeeze(1)
        lse = _softmax_(z)[1]
        return lse, z_label - lse


class ChunkedSequenceLogProbs(torch.autograd.Function):
    """Summed log p(label) of each row's labelled tokens, ``rows`` tokens at a time; backward recomputes each
    chunk's logits from the saved hidden states and per-token log-sum-exp (torchtune's chunked cross-entropy; Cut
    Cross-Entropy, Wijmans et al. 2024), so only (N,) numbers outlive the forward pass besides the inputs.

    forward(hidden (N, C) the rows of B sequences of T = N / B tokens each, one after the other, weight (V_local,
    C), labels (N,) long, n_sequences int B, ignore_index int, rows int, dtype torch.dtype, vocab ``WholeVocab`` or a
    ``VocabSlice``) -> (B,) fp32, each sequence's sum over its T tokens as ``Tensor.sum`` orders it (as the full
    path's row sums). Backward: d z = (onehot(y) - softmax(z)) · g_b · valid (b the token's sequence; the onehot
    where this process holds the label), then d h = d z · W and d W = Σ d zᵀ · h_c (fp32), as ``ChunkedLinearCrossEntropy``;
    under a ``VocabSlice`` d h is this rank's partial sum (the caller's entry into the TP region sums it).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, n_sequences: int, ignore_index: int, rows: int,
                dtype: torch.dtype, vocab: WholeVocab) -> Tensor:
        h = hidden.to(dtype)
        w = _Weight(weight, dtype, cast_whole(h.shape[0], weight, dtype), weight_rows(*weight.shape, h.device))
        valid = labels != ignore_index
        idx, mine = vocab.owned(labels, valid, weight.shape[0])  # (N, 1), (N,)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)  # (N,)
        logp = torch.empty_like(lse)  # (N,)
        for s in range(0, h.shape[0], rows):
            lse[s:s + rows], logp[s:s + rows] = vocab.lse_logp(w.logits(h[s:s + rows]), idx[s:s + rows],
                                                                mine[s:s + rows])
        out = logp.masked_fill_(~valid, 0.0).view(n_sequences, -1).sum(1)  # (B,)
        ctx.save_for_backward(hidden, weight, idx, valid, mine, lse)
        ctx.rows, ctx.dtype = rows, dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, idx, valid, mine, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        dtype, rows = ctx.dtype, ctx.rows
        h = hidden.to(dtype)
        w = _Weight(weight, dtype, cast_whole(h.shape[0], weight, dtype), weight_rows(*weight.shape, h.device))
        row_weight = grad.float().repeat_interleave(len(valid) // len(grad)) * valid  # (N,): d out[b] / d log p
        onehot = -mine.float()[:, None]  # (N, 1): -1 where this process holds the label's logit
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        for s in range(0, h.shape[0], rows):
            h_c = h[s:s + rows]
            p = w.logits(h_c).sub_(lse[s:s + rows, None]).exp_()  # (r, V) softmax (this rank's columns)
            p.scatter_add_(1, idx[s:s + rows], onehot[s:s + rows])  # softmax - onehot
            g = p.mul_(-row_weight[s:s + rows, None]).to(dtype)  # (r, V): d out / d z
            del p
            w.grads(g, h_c, None if grad_h is None else grad_h[s:s + rows], grad_w)
            del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None)


def sequence_logps(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int = -100, *,
                   rows: int | None = None, vocab: WholeVocab | None = None) -> Tensor:
    """Per-sequence summed log-probabilities Σ_t log softmax(h_t · Wᵀ)[y_t] over the tokens whose label is not
    ``ignore_index``, without the (B, T, V) logits (``ChunkedSequenceLogProbs``): the policy and reference
    log-likelihoods preference losses compare (DPO, Rafailov et al. 2023; TRL's ``logps/chosen``).

    Args:
        hidden: (B, T, C) float; weight: (V, C), or this rank's (V_r, C) with ``vocab``; labels: (B, T) long.
        rows: tokens per chunk (default ``chunk_rows``).
        vocab: where the vocabulary is (default ``WholeVocab``: all of ``weight``; a TP rank's slice,
            :func:`~torch_handle.model.linear_cross_entropy_tp.vocab_parallel_sequence_logps`).

    Returns:
        (B,) fp32, differentiable in ``hidden`` and ``weight``; 0 for a sequence with no counted token.

    Raises:
        ValueError: shapes that do not fit.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2] or weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"sequence_logps: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and labels "
                         f"{tuple(labels.shape)} do not fit ((B, T, C), (V, C), (B, T))")
    B, T = labels.shape
    flat = hidden.reshape(B * T, -1)  # (N, C)
    rows = rows or chunk_rows(flat.shape[0], weight.shape[0], flat.device)
    return ChunkedSequenceLogProbs.apply(flat, weight, labels.reshape(-1), B, ignore_index, rows,
                                         compute_dtype(hidden), vocab or WholeVocab())
