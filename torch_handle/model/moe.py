"""The mixture-of-experts feed-forward network: a router sends each token to k of E expert FFNs and sums their
outputs by the router's weights (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al.
2020; Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024; Qwen 3 MoE).

Read after ``router.py`` (who goes where) and ``feed_forward.py`` (what one expert computes). One MoE layer is
four steps, each a function or module of its own, so that expert parallelism can put its all-to-alls between
them (the tokens travel between dispatch and the experts, and back before combine):

1. route    -- ``TopKRouter`` (router.py): per token k experts and their weights, in fp32.
2. dispatch -- ``dispatch``: the N·k assignments sorted by expert (a stable permutation, optionally cut to each
   expert's capacity) and the token rows gathered in that order, with the count per expert.
3. experts  -- ``GroupedExperts``: every expert's FFN over its contiguous run of the sorted rows; the weights of
   all experts stacked in one tensor per matrix, computed as one grouped matmul (``torch._grouped_mm``) or, as the
   readable reference, a loop over the experts.
4. combine  -- ``combine``: the rows put back in token order and each token's k outputs summed by its weights.

``MoEFeedForward`` composes them, adds optional shared experts (DeepSeekMoE), attaches the balancing losses to its
output (``aux_loss.py``) and counts its routing (``stats``; read, reduced and reset by ``torch_handle.train.routing``).

Shape letters: B batch, T sequence length, N = B·T tokens, C = d_model channels, E experts, k = top_k,
M = N·k - dropped rows of the sorted buffer, F = d_ff of one expert.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.args import BALANCES, MLP, MLPS, TransformerArgs, check_choice
from torch_handle.model.aux_loss import LossScaleSource, attach_aux_loss
from torch_handle.model.feed_forward import build_feed_forward
from torch_handle.model.kernels import Dropout
from torch_handle.model.router import Routing, TopKRouter, load_balancing_loss, router_z_loss

ExpertsImpl = Literal["grouped", "loop"]


# -- 2. dispatch and 4. combine ------------------------------------------------------------------------------------
class Dispatch(NamedTuple):
    """How ``dispatch`` laid the assignments out: what ``combine`` (and, across ranks, expert parallelism) needs to
    undo it.

    Fields:
        order: (M,) int64, for each row of the sorted buffer its assignment t·k + j (token t's j-th expert),
            rows grouped by expert in expert order, within an expert in token order.
        counts: (E,) int64, rows per expert (after capacity): the group sizes of the experts' grouped matmul.
        routed: (E,) int64, assignments per expert before any drop: the load (balancing loss, telemetry).
        n_tokens: N.
        top_k: k.
    """

    order: Tensor
    counts: Tensor
    routed: Tensor
    n_tokens: int
    top_k: int

    @property
    def dropped(self) -> int:
        """Assignments cut by the capacity (N·k - M): their tokens keep only the residual and shared experts."""
        return self.n_tokens * self.top_k - self.order.numel()


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Rows an expert takes: ceil(capacity_factor · N · k / E) (Switch Transformer §2.2, with GShard's k; Megatron's
    ``get_capacity``). A factor of 1 is exactly the uniform load."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def dispatch(x: Tensor, experts: Tensor, n_experts: int, capacity: int | None = None) -> tuple[Tensor, Dispatch]:
    """Sort the N·k (token, expert) assignments by expert and gather the tokens' rows in that order.

    The permutation is a stable argsort of the flattened expert ids: within an expert the tokens stay in batch
    order, so a capacity keeps each expert's first ``capacity`` tokens of the batch and drops the rest (Switch
    Transformer's policy; Megatron's ``drop_policy="position"``). No host synchronisation without a capacity (the
    buffer has N·k rows); with one, its size depends on the routing.

    Args:
        x: (N, C) token rows.
        experts: (N, k) int64, each token's experts (``Routing.experts``).
        n_experts: E.
        capacity: rows per expert at most, or None (dropless).

    Returns:
        (x_sorted (M, C), ``Dispatch``): row i of x_sorted is x[order[i] // k].
    """
    n_tokens, top_k = experts.shape
    flat = experts.flatten()  # (N·k,): assignment t·k + j -> its expert
    order = torch.argsort(flat, stable=True)  # (N·k,)
    # a scatter-add, not bincount: no host read of the largest id on CUDA
    routed = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                       torch.ones_like(flat))
    counts = routed
    if capacity is not None:
        first_row = routed.cumsum(0) - routed  # (E,): where each expert's run starts in the sorted order
        place = torch.arange(flat.numel(), device=flat.device) - first_row[flat[order]]  # (N·k,) rank in its run
        order = order[place < capacity]  # (M,)
        counts = routed.clamp(max=capacity)
    return x[order // top_k], Dispatch(order, counts, routed, n_tokens, top_k)


def combine(y_sorted: Tensor, dispatched: Dispatch, weights: Tensor) -> Tensor:
    """Undo ``dispatch`` and mix: each row goes back to its (token, slot) place (dropped slots are zeros), then each
    token's k rows are summed with its weights, in a fixed order (deterministic, unlike an atomic scatter-add).

    Args:
        y_sorted: (M, C), the experts' outputs in the sorted order.
        dispatched: what ``dispatch`` returned with the rows.
        weights: (N, k) fp32, the router's weights (``Routing.weights``); cast to y's dtype (as transformers does).

    Returns:
        (N, C) in y_sorted's dtype.
    """
    n_tokens, top_k = dispatched.n_tokens, dispatched.top_k
    slots = y_sorted.new_zeros(n_tokens * top_k, y_sorted.shape[-1]).index_copy(0, dispatched.order, y_sorted)
    return (slots.view(n_tokens, top_k, -1) * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)


# -- 3. the experts ------------------------------------------------------------------------------------------------
def _local(w: Tensor) -> Tensor:
    """A DTensor's local shard (the experts this rank holds under native expert parallelism); a tensor as it is."""
    return w.to_local() if hasattr(w, "to_local") else w


def _matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in: autocast's when it is on (``_grouped_mm`` is not on its lists)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


@torch.library.custom_op("torch_handle::grouped_mm", mutates_args=())
def _grouped_op(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a (M, K), b (E, K, N), offs=offs (E,) int32)`` -> (M, N), opaque to ``torch.compile``
    (``register_fake`` gives its shape): what a compiled block calls for a dtype ``_grouped_mm``'s meta function
    refuses."""
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_op.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("torch_handle::grouped_mm_weight_grad", mutates_args=())
def _grouped_weight_grad(a: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    """The gradient of ``_grouped_op``'s b: for each expert's rows aᵀ·grad, (E, K, N) (as ``_grouped_mm``'s own
    backward: a 2-d x 2-d grouped matmul split along M)."""
    return torch._grouped_mm(a.transpose(0, 1), grad, offs=offs)


@_grouped_weight_grad.register_fake
def _(a: Tensor, grad: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(offs.shape[0], a.shape[1], grad.shape[1])


def _grouped_op_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    a, b, offs = ctx.saved_tensors
    return _grouped_op(grad, b.transpose(-2, -1), offs), _grouped_weight_grad(a, grad, offs), None


def _grouped_op_save(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


_grouped_op.register_autograd(_grouped_op_backward, setup_context=_grouped_op_save)


_NO_KERNEL = re.compile(r"could not run|not implemented|not supported|only supported|no kernel|unsupported"
                        r"|expected mat_[ab] to be|strides should be multiple", re.IGNORECASE)
"""What ``torch._grouped_mm``'s refusals say when it has no kernel for a device, dtype or shape (torch 2.13: "Could
not run 'aten::_grouped_mm' with arguments from the ... backend", "Expected mat_a to be Float32, BFloat16 or Float16
matrix", "strides should be multiple of 16 bytes")."""


def no_grouped_kernel(error: BaseException) -> bool:
    """Whether ``error``, raised by ``torch._grouped_mm``, means it has no kernel for this device, dtype or shape
    (the experts fall back to the loop) rather than the failure of a kernel that exists: never an out-of-memory
    error (``torch.OutOfMemoryError``, a ``RuntimeError``), a device fault or any other message, which propagate."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, NotImplementedError):
        return True
    return isinstance(error, RuntimeError) and _NO_KERNEL.search(str(error)) is not None


class GroupedExperts(nn.Module):
    """E expert FFNs with their weights stacked, one tensor per matrix, each expert's slice laid out as
    ``nn.Linear``'s (out, in): ``"swiglu"`` -- gate_proj (E, F, C), up_proj (E, F, C), down_proj (E, C, F):
    down(SiLU(gate x) ⊙ up x) as ``SwiGLUFeedForward``; ``"relu"`` / ``"gelu"`` -- up_proj (E, F, C), down_proj
    (E, C, F): down(act(up x)). No biases (none in Mixtral, Qwen 3 MoE or DeepSeek-V3). transformers' fused
    ``gate_up_proj`` (E, 2F, C) is gate_proj and up_proj concatenated along F.

    ``impl`` picks how: ``"grouped"`` (default) runs each matrix as one ``torch._grouped_mm`` over the sorted rows
    with the experts' offsets (one kernel for all experts; forward + backward against the loop, equal in fp32:
    on CPU in torch 2.13 about 3x faster at E = 8; on an H100, torch 2.11, 4.5x at presets/moe.toml's shape and 8.8x
    at E = 64, C = 1024 in bf16, 1.8-2.0x in fp32: benchmarks/moe_experts.py; a device without the kernel falls
    back to the loop, once and for good, and only then: ``no_grouped_kernel``); ``"loop"`` runs expert after
    expert on its slice, the readable reference (the same formula, ``_mlp``). Both give every expert's slice a
    gradient, zero for an expert that got no rows, so no parameter is ever unused (DDP needs no
    ``find_unused_parameters``).

    Args:
        n_experts: E.
        d_model: C.
        d_ff: F, one expert's hidden width.
        mlp: ``"swiglu"``, ``"gelu"`` or ``"relu"``.
        dropout: on the hidden units, as in the dense FFN.

    Shape:
        forward(x (M, C) rows sorted by expert, counts (E,) int64 rows per expert) -> (M, C).

    Raises:
        ValueError: an unknown ``mlp`` or ``impl``.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, mlp: MLP = "swiglu", dropout: float = 0.0) -> None:
        super().__init__()
        check_choice("mlp", mlp, MLPS)
        self.n_experts, self.mlp = n_experts, mlp
        self.gate_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model)) if mlp == "swiglu" else None
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.dropout = Dropout(dropout)
        self.impl: ExpertsImpl = "grouped"
        self.grouped_ok: dict[str, bool] = {}
        """Device type -> whether ``torch._grouped_mm`` ran there (absent: not tried yet)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices Xavier-uniform, as the dense FFN's linears (bound √(6 / (fan_in + fan_out)) of
        one (out, in) slice: ``xavier_uniform_`` on the 3-d tensor would count E into the fans)."""
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            if w is not None:
                bound = math.sqrt(6.0 / (w.shape[1] + w.shape[2]))
                nn.init.uniform_(w, -bound, bound)

    def _mlp(self, x: Tensor, linear: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """One expert FFN over rows ``x``, ``linear(h, w)`` applying the stacked matrix ``w`` to the rows. Under
        native expert parallelism the weights are DTensors: this rank computes with its experts, their local shard."""
        up, down = _local(self.up_proj), _local(self.down_proj)
        if self.mlp == "swiglu":
            h = F.silu(linear(x, _local(self.gate_proj))) * linear(x, up)  # (rows, F)
        else:
            h = (F.relu if self.mlp == "relu" else F.gelu)(linear(x, up))
        return linear(self.dropout(h), down)  # (rows, C)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        if self.impl not in ("grouped", "loop"):
            raise ValueError(f"unknown experts impl {self.impl!r}; expected 'grouped' or 'loop'")
        if self.impl == "grouped" and hasattr(torch, "_grouped_mm") and self.grouped_ok.get(x.device.type, True):
            try:
                return self._grouped(x, counts)
            except (RuntimeError, NotImplementedError) as error:
                if not no_grouped_kernel(error):  # out of memory, a device fault: not a reason to loop
                    raise
                self.grouped_ok[x.device.type] = False
        return self._looped(x, counts)

    def _grouped(self, x: Tensor, counts: Tensor) -> Tensor:
        offsets = counts.cumsum(0).to(torch.int32)  # (E,): end row of each expert's run
        dtype = _matmul_dtype(x)
        # traced, a 16-bit grouped matmul is torch's op; any other dtype goes through an opaque op (_grouped_mm's
        # meta function takes bf16 only, as the CUDA kernel once did, though eager runs fp32 on CPU and CUDA)
        grouped_mm = torch._grouped_mm if dtype == torch.bfloat16 or not torch.compiler.is_compiling() else _grouped_op

        def linear(h: Tensor, w: Tensor) -> Tensor:  # (M, in) x (E, out, in) -> (M, out), expert by offsets
            return grouped_mm(h.to(dtype), w.to(dtype).transpose(-2, -1), offs=offsets)

        return self._mlp(x, linear)

    def _looped(self, x: Tensor, counts: Tensor) -> Tensor:
        outputs = []
        for e, rows in enumerate(x.split(counts.tolist())):  # the split sizes: one host read
            outputs.append(self._mlp(rows, lambda h, w: h @ w[e].transpose(0, 1)))  # (rows_e, C)
        return torch.cat(outputs)

    def params_per_expert(self) -> int:
        """Parameters of one expert (its slices of the stacked tensors)."""
        return sum(p[0].numel() for p in self.parameters())


# -- the layer -----------------------------------------------------------------------------------------------------
ROUTING_COUNTS = ("assignments", "dropped", "aux_loss", "z_loss", "micro_batches")
"""The keys of ``MoEFeedForward.stats``, in this order: assignments per expert after capacity (E,; the step
events' ``tokens_per_expert``), dropped assignments (``dropped_tokens``), the aux and z losses' values (sums over
micro-batches), micro-batches counted."""


def in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing then recomputes a forward, whose routing
    must not be counted twice."""
    return torch._C._current_graph_task_id() != -1


@torch.library.custom_op("torch_handle::routing_counted", mutates_args=())
def _counted_flag(like: Tensor) -> Tensor:
    """``not in_backward()`` as a 0-d int64 tensor (1 or 0) on ``like``'s device, read when it runs: a compiled
    block calls it instead of branching on a host flag that Dynamo can neither trace nor guard (an activation
    checkpoint's recompute runs the same compiled graph inside backward)."""
    return torch.tensor(int(not in_backward()), dtype=torch.int64, device=like.device)


@_counted_flag.register_fake
def _(like: Tensor) -> Tensor:
    return like.new_empty((), dtype=torch.int64)


class MoEFeedForward(nn.Module):
    """A mixture-of-experts feed-forward network, in place of a layer's FFN: y = Σⱼ wⱼ · expertⱼ(x) over the
    token's k routed experts (+ shared(x)).

    ``args`` (``TransformerArgs``) gives the sizes (d_model; d_ff_expert, or d_ff), the expert FFN (``mlp``), the
    dropout, and every MoE option: n_experts, top_k, n_shared_experts, capacity_factor, router, norm_topk_prob,
    balance, router_aux_loss, router_z_loss, bias_update_rate (their documentation: ``args.py``). With
    ``router="softmax"``, no shared experts and no capacity this is ``transformers``' ``Qwen3MoeSparseMoeBlock``
    (and with norm_topk_prob Mixtral's block); with ``router="sigmoid"``, norm_topk_prob, ``balance="aux_free"`` and
    shared experts, DeepSeek-V3's ``DeepseekV3MoE`` with one expert group and ``routed_scaling_factor`` 1. The
    parameter names are theirs: ``gate.weight``, ``experts.*_proj``, ``shared_experts.*_proj``.

    While training, the objective gains router_aux_loss · ``load_balancing_loss`` (balance = "aux_loss") plus
    router_z_loss · ``router_z_loss``, attached to the output (``attach_aux_loss``, scaled by ``aux_loss_scale``):
    the loop computes its loss as before. Each training forward also adds its counts to ``stats`` (on the device,
    no host read; ``ROUTING_COUNTS``) and the router's ``pending_load``: the model computes them, the training code
    (:mod:`torch_handle.train.routing`) reads, reduces and resets them and moves the expert biases.

    Shape:
        forward(x (B, T, C)) -> (B, T, C).

    Raises:
        ValueError: top_k not in [1, n_experts], an unknown router, balance or mlp.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        check_choice("balance", args.balance, BALANCES)
        self.n_experts, self.top_k, self.balance = args.n_experts, args.top_k, args.balance
        self.capacity_factor = args.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = args.router_aux_loss, args.router_z_loss
        d_ff = args.d_ff_expert or args.d_ff
        self.gate = TopKRouter(args.d_model, args.n_experts, args.top_k, score=args.router,
                               norm_topk_prob=args.norm_topk_prob, expert_bias=args.balance == "aux_free",
                               bias_update_rate=args.bias_update_rate)
        self.experts = GroupedExperts(args.n_experts, args.d_model, d_ff, args.mlp, args.dropout)
        self.shared_experts = (build_feed_forward(args.mlp, args.d_model, args.n_shared_experts * d_ff, args.dropout,
                                                  args.bias) if args.n_shared_experts else None)
        # plain tensors, not buffers: DDP would overwrite every rank's counts with rank 0's at each forward
        self.stats: dict[str, Tensor] | None = None
        """This layer's routing since the training code last reset it (None), keys ``ROUTING_COUNTS``."""
        self.aux_loss_scale: LossScaleSource | None = None
        """What the attached losses read their gradient from in backward (bound by the training code: ``AuxLossScale``;
        None: 1)."""

    def empty_stats(self) -> dict[str, Tensor]:
        """``stats`` before any counted forward: zeros on the layer's device."""
        device = self.gate.weight.device
        return {"assignments": torch.zeros(self.n_experts, dtype=torch.int64, device=device),
                "dropped": torch.zeros((), dtype=torch.int64, device=device),
                "aux_loss": torch.zeros((), device=device), "z_loss": torch.zeros((), device=device),
                "micro_batches": torch.zeros((), dtype=torch.int64, device=device)}

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        h = x.reshape(B * T, C)  # (N, C)
        routing = self.gate(h)
        capacity = (None if self.capacity_factor is None
                    else expert_capacity(B * T, self.top_k, self.n_experts, self.capacity_factor))
        h_sorted, dispatched = dispatch(h, routing.experts, self.n_experts, capacity)  # (M, C)
        y = combine(self.experts(h_sorted, dispatched.counts), dispatched, routing.weights)  # (N, C)
        if self.shared_experts is not None:
            y = y + self.shared_experts(h)
        y = y.view(B, T, C)
        return self._balance(y, routing, dispatched) if self.training else y

    def _balance(self, y: Tensor, routing: Routing, dispatched: Dispatch) -> Tensor:
        """The training-time extras: the balancing losses attached to ``y``, the statistics, the load for the
        expert bias."""
        aux = load_balancing_loss(routing.probs, dispatched.routed, self.top_k)
        z = router_z_loss(routing.logits)
        if torch.compiler.is_compiling():  # decided when the graph runs, not baked in when it is traced
            self._count(dispatched, aux, z, _counted_flag(dispatched.routed))
        elif not in_backward():
            self._count(dispatched, aux, z, 1)
        terms = [coef * loss for coef, loss in ((self.aux_loss_coef if self.balance == "aux_loss" else 0.0, aux),
                                                (self.z_loss_coef, z)) if coef]
        return attach_aux_loss(y, sum(terms), self.aux_loss_scale) if terms else y

    def _count(self, dispatched: Dispatch, aux: Tensor, z: Tensor, counted: Tensor | int) -> None:
        """Add one micro-batch's routing to ``stats`` and the router's pending load, each times ``counted`` (1, or
        a 0-d int64 tensor of 0 or 1 under ``torch.compile``: ``_counted_flag``)."""
        if self.stats is None:
            self.stats = self.empty_stats()
        s = self.stats
        s["assignments"] += dispatched.counts * counted
        s["dropped"] += (dispatched.routed.sum() - dispatched.counts.sum()) * counted
        s["aux_loss"] += aux.detach() * counted
        s["z_loss"] += z.detach() * counted
        s["micro_batches"] += counted
        self.gate.record_load(dispatched.routed * counted)

    @property
    def inactive_params(self) -> int:
        """Routed-expert parameters a token does not pass through: (E - k) experts' worth. Training FLOPs count the
        active parameters only (``DecoderLM.flops_per_token``)."""
        return (self.n_experts - self.top_k) * self.experts.params_per_expert()


def named_moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """(name, layer) of the model's MoE feed-forward networks, in module order (layer order), each named by the
    decoder layer that holds it: its module path without the FFN's own ``.ff`` -- ``layers.3``,
    ``decoder.layers.2`` (the step events' ``moe.layers``, docs/run-directory.md); ``""`` for ``model`` itself."""
    return [(name.removesuffix(".ff"), m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE feed-forward networks, in module order (layer order)."""
    return [m for _, m in named_moe_layers(model)]
