"""Step 4 of the model: two Transformers built from the same layers and one set of arguments.

* ``DecoderLM``      -- GPT-style decoder-only language model.
* ``EncoderDecoder`` -- the original encoder-decoder Transformer (Vaswani et al. 2017, fig. 1), one shared
  vocabulary.
* ``build_transformer`` -- the model a ``kind`` names, from ``TransformerArgs`` (``args.py``).

Read after ``embeddings.py``, ``attention.py`` and ``layers.py`` (the package docstring gives the whole path).

Both models declare their repeated layers with ``blocks()`` (the ``BlockModel`` protocol): each block is
checkpointed on its own (``activation_checkpointing``) and is the unit a sharding wrapper such as FSDP2 gathers
and frees. ``model.attention = "reference"`` switches the kernel of every attention module at once.

Data-dependent checks (is a batch padded? does it cross a document boundary?) read values back to the host, which
``torch.compile`` cannot trace: a caller that compiles the model hands the forward what ``checked_inputs`` decided
once per batch (the trainer does), and the forward reads nothing back.

Shape letters: B batch, T target length, S source length, C = d_model channels, V vocabulary size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from torch_handle.model.args import POSITIONS, AttentionImpl, ModelKind, TransformerArgs, check_choice
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.embeddings import PositionsInAttention, SinusoidalPositionalEncoding, embed_tokens
from torch_handle.model.flops import matmul_params, training_flops_per_token
from torch_handle.model.kernels import Dropout
from torch_handle.model.kv_cache import KVCache, LayerCache
from torch_handle.model.layers import DecoderLayer, EncoderLayer
from torch_handle.model.moe import MoEFeedForward
from torch_handle.model.norms import build_norm
from torch_handle.model.profiling import record_range
from torch_handle.model.rope import rope_table
from torch_handle.parallel.tensor.random import checkpoint_rng_contexts

CHECK = "check"
"""The default of the forward's mask arguments: the model decides itself from the ids (a host read per forward, and
under ``torch.compile`` the mask is built whatever it holds, with no read); a tensor or None: the caller decided
(``checked_inputs``)."""


def padding_mask_of(ids: Tensor, pad_id: int | None) -> Tensor | None:
    """The key-padding mask of ``ids`` (B, T): bool (B, T), True where ``ids == pad_id``; None when ``pad_id`` is
    None or no id is ``pad_id``.

    None lets attention hand ``F.scaled_dot_product_attention`` no mask tensor, only ``is_causal``, so that it may
    pick a fused kernel -- FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact
    Attention with IO-Awareness"; the CPU flash kernel likewise) -- where a mask tensor would force the
    memory-efficient or math kernel and a (B, 1, T, S) mask built per layer (the SDPA documentation,
    https://docs.pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html).
    Language-model windows are never padded (``LMDataset`` cuts one token stream), so their batches take that path;
    translation batches (``pad_collate``) and left-padded prompts keep their mask.

    The ``.any()`` reads one bool back to the host: a CUDA synchronisation, once per model (or pipeline stage)
    forward, outside the blocks (and so outside their ``torch.compile`` regions); every tensor-parallel rank and
    every pipeline stage sees the same ids and takes the same decision. Ids whose values cannot be read (fake or meta
    tensors: ``handle estimate`` runs the model on them, with ids drawn above the special tokens) count as
    unpadded, as a language-model batch is.
    """
    if pad_id is None:
        return None
    if torch.compiler.is_compiling():  # reading the mask back would break the graph: keep it, whatever it holds
        return ids == pad_id  # (B, T)
    if ids.device.type == "meta" or is_fake(ids):
        return None
    mask = ids == pad_id  # (B, T)
    return mask if bool(mask.any()) else None


def document_mask_of(position_ids: Tensor | None) -> Tensor | None:
    """The block-causal attention mask of packed documents: bool (B, 1, T, T), True where query t may attend key s,
    i.e. s <= t and both lie in the same document; None when ``position_ids`` is None or every row of it is
    0 .. T - 1 (the window crosses no document boundary: plain causal attention).

    ``position_ids`` LongTensor (B, T) is each token's position inside its document, restarting at 0 at every
    document start (and at the window's first token). The documents are the segments ``cumsum(position_ids == 0)``
    along T. This is torchtitan's document masking (block-causal mask, positions restarting at each document:
    pytorch/torchtitan#3130, #3149) and Hugging Face's packing with ``position_ids`` ("packing with
    position_ids", ``DataCollatorWithFlattening``: attention never crosses a position reset). Each document then
    computes what it computes on its own.

    Built once per batch by the model's forward, outside the blocks (and so outside their ``torch.compile``
    regions), and handed to every block; (B, 1, T, T) bytes: 4 MiB for B = 4, T = 1024. None keeps SDPA's
    ``is_causal`` fast path (no mask tensor: see ``padding_mask_of``); deciding it reads one bool back to the host,
    as ``padding_mask_of`` does. Ids whose values cannot be read (fake or meta tensors: ``handle estimate``) get
    the mask, so the estimate prices it.
    """
    if position_ids is None:
        return None
    T = position_ids.shape[1]
    readable = (not torch.compiler.is_compiling() and position_ids.device.type != "meta"
                and not is_fake(position_ids))
    if readable and bool((position_ids == torch.arange(T, device=position_ids.device)).all()):
        return None
    segment = (position_ids == 0).cumsum(dim=1)  # (B, T): the document of each token
    same = segment[:, :, None] == segment[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()  # (T, T)
    return (same & causal)[:, None]  # (B, 1, T, T)


def documents_of(input_ids: Tensor, position_ids: Tensor | None, document_mask: Tensor | None | str = CHECK
                 ) -> dict[str, Tensor]:
    """The keyword arguments that hand a decoder block its packed documents: ``attn_mask`` (B, 1, T, T) and
    ``position_ids`` (B, T) (``document_mask_of``, or ``document_mask`` when the caller built it: None then means
    no boundary); none when ``position_ids`` is None or crosses no document boundary, so the blocks are called as
    without documents.

    Raises:
        ValueError: ``position_ids`` not of ``input_ids``' shape (B, T); a ``document_mask`` without them."""
    if position_ids is None:
        if isinstance(document_mask, Tensor):
            raise ValueError("a document_mask needs the position_ids it was built from")
        return {}
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(position_ids.shape)}")
    mask = document_mask_of(position_ids) if isinstance(document_mask, str) else document_mask
    return {} if mask is None else {"attn_mask": mask, "position_ids": position_ids}


class _TransformerModel(nn.Module):
    """What DecoderLM and EncoderDecoder share: token embedding + positional encoding on the
    way in, optional tied output projection on the way out, the block list (``blocks``) with
    per-block activation checkpointing, the attention switch, init and accounting.

    ``self.args`` is the ``TransformerArgs`` the model was built from.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.d_model)
        # RoPE: positions enter inside attention, nothing is added here (but the module keeps the length check)
        self.pos_encoding = (SinusoidalPositionalEncoding(args.d_model, args.max_len) if args.position == "sinusoidal"
                             else PositionsInAttention(args.max_len))
        self.embed_dropout = Dropout(args.dropout)
        if args.position == "rope":
            # cos and sin of every position once, fp32, handed to every block (rope.rope_table: why not per call);
            # not persistent: derived from the arguments, so neither in checkpoints nor in the HF export
            for name, table in zip(("rope_cos", "rope_sin"), rope_table(args.max_len, args.d_k, args.rope_theta)):
                self.register_buffer(name, table, persistent=False)  # (max_len, d_k)

    def _rope(self) -> dict[str, tuple[Tensor, Tensor]]:
        """The keyword argument that hands every block the RoPE table (``rope_table``); none without RoPE."""
        return {"rope_table": (self.rope_cos, self.rope_sin)} if hasattr(self, "rope_cos") else {}

    def _layer_kwargs(self) -> dict:
        """The ``TransformerArgs`` every ``EncoderLayer`` / ``DecoderLayer`` takes."""
        a = self.args
        check_choice("position", a.position, POSITIONS)
        return {"dropout": a.dropout, "mlp": a.mlp, "norm_first": a.norm_first, "attention": a.attention,
                "fused_qkv": a.fused_qkv, "norm_eps": a.norm_eps, "norm": a.norm, "bias": a.bias,
                "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim, "qk_norm": a.qk_norm,
                "rope_theta": a.rope_theta if a.position == "rope" else None}

    def _feed_forward(self, i: int) -> dict:
        """The keyword argument that makes layer ``i`` of a stack an MoE layer (``args.is_moe_layer``); none for a
        dense layer."""
        if not self.args.is_moe_layer(i):
            return {}
        return {"feed_forward": lambda: MoEFeedForward(self.args)}

    def _final_norm(self) -> nn.Module:
        """Pre-LN leaves the residual stream un-normalised, so a pre-LN stack ends with a norm; post-LN's last
        sub-layer already normalised it."""
        a = self.args
        return build_norm(a.norm, a.d_model, a.norm_eps, a.bias) if a.norm_first else nn.Identity()

    def blocks(self) -> list[nn.Module]:
        """The repeated Transformer layers, in forward order.

        Each is run through ``_run_block`` (so it is checkpointed on its own when
        ``args.activation_checkpointing`` is set), and a sharding wrapper may make each its own unit
        (the ``fsdp`` strategy calls ``fully_shard`` on every block, then on the whole model).
        """
        raise NotImplementedError

    @property
    def n_layers_total(self) -> int:
        """Number of Transformer layers (encoder + decoder): ``len(self.blocks())``."""
        return len(self.blocks())

    @property
    def attention(self) -> AttentionImpl:
        """Attention kernel of the model's ``MultiHeadAttention`` modules, ``"sdpa"`` or ``"reference"``.

        Assigning it switches every attention module at once (each checks the name: an unknown one
        raises ValueError before anything changed).
        """
        return next(m for m in self.modules() if isinstance(m, MultiHeadAttention)).attention

    @attention.setter
    def attention(self, impl: AttentionImpl) -> None:
        for module in self.modules():
            if isinstance(module, MultiHeadAttention):
                module.attention = impl

    def _make_lm_head(self) -> nn.Linear:
        """Output projection C -> V; subclasses create it after their layers so the module
        tree reads in data-flow order."""
        lm_head = nn.Linear(self.args.d_model, self.args.vocab_size, bias=False)
        if self.args.tie_embeddings:
            # Press & Wolf 2017; Vaswani et al. 2017 §3.4: one matrix for input and output.
            lm_head.weight = self.embed.weight
        return lm_head

    def _reset_parameters(self) -> None:
        """Embedding (and untied output) weights ~ N(0, d_model^-0.5).

        With the √d_model input scaling this gives unit-variance token embeddings, and with a
        tied head it keeps initial logits O(1). The layers initialise themselves (Xavier).
        Only torch's global RNG is used, so the same seed builds the same model.
        """
        std = self.args.d_model**-0.5
        nn.init.normal_(self.embed.weight, mean=0.0, std=std)
        if not self.args.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)

    def _embed(self, ids: Tensor, offset: int = 0, position_ids: Tensor | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, C): embedding (scaled by √C unless ``scale_embeddings`` is off) + position
        (from ``offset``, or ``position_ids`` (B, T) of packed documents; nothing under RoPE), then dropout
        (§3.4)."""
        x = embed_tokens(self.embed, ids, scale=self.args.scale_embeddings)  # (B, T, C)
        pos = {} if position_ids is None else {"position_ids": position_ids}
        return self.embed_dropout(self.pos_encoding(x, offset, **pos))

    def _padding_mask(self, ids: Tensor, given: Tensor | None | str = CHECK) -> Tensor | None:
        """bool (B, T), True where ids == pad_id; None when nothing is padded (``padding_mask_of``); ``given``
        when the caller decided (``checked_inputs``)."""
        return padding_mask_of(ids, self.args.pad_id) if isinstance(given, str) else given

    def _decoder_input(self, ids: Tensor, cache: KVCache | None, position_ids: Tensor | None = None,
                       padding_mask: Tensor | None | str = CHECK) -> tuple[Tensor, Tensor | None]:
        """The decoder stack's input: ids (B, T) embedded from position ``cache.length`` (or at ``position_ids``
        (B, T)) (B, T, C), and the padding mask of every key, the P cached positions' first (B, P + T), or None
        while none of them is padded (``padding_mask``: the caller's decision for ids). Advances ``cache``."""
        mask = self._padding_mask(ids, padding_mask)  # (B, T) or None
        x = self._embed(ids, 0 if cache is None else cache.length, position_ids)  # (B, T, C)
        if cache is not None:
            mask = cache.extend_padding(mask, ids.shape[1])  # (B, P + T) or None
            cache.length += ids.shape[1]
        return x, mask

    def _run_block(self, name: str, block: nn.Module, *args, **kwargs) -> Tensor:
        """Call ``block`` (one of ``blocks()``) inside the profiler range ``name`` (e.g. ``"decoder.layer3"``;
        see ``profiling.py``); with activation checkpointing on (and training), store only its input and
        recompute its activations in the backward pass -- trades ~1 extra forward for O(n_layers) less
        activation memory (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost")."""
        with record_range(name):
            if self.args.activation_checkpointing and self.training:
                # context_fn: the recompute draws the tensor-parallel dropout masks the forward drew
                return checkpoint(block, *args, use_reentrant=False, context_fn=checkpoint_rng_contexts, **kwargs)
            return block(*args, **kwargs)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of trainable parameters, each shared tensor counted once.

        Args:
            exclude_embeddings: leave out the token-embedding table (the positional table is a
                buffer and never counted). With tied embeddings this also removes the output
                projection, since it is the same tensor -- Kaplan et al. 2020's
                "non-embedding parameters".
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() de-duplicates tied weights
        if exclude_embeddings:
            n -= self.embed.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token: ``flops.training_flops_per_token`` with N the parameters
        that take part in a matmul (all but the input embedding table, which is only indexed; with tied embeddings
        that table *is* the output projection, so it counts once: N == ``num_params()``), L = ``n_layers_total``
        and the attention width n_heads · d_k (d_model unless ``head_dim`` is given; grouped-query attention
        shrinks K and V, not the scores). With experts, N counts the parameters a token passes through: its top_k
        routed experts of E (``MoEFeedForward.inactive_params``; the router and shared experts count). For the encoder-decoder, "per token" means per target token with source
        and target both ``seq_len`` long; the cross-attention score term is not included (a small undercount).
        """
        n_matmul = matmul_params(self, self.lm_head) - sum(getattr(m, "inactive_params", 0) for m in self.modules())
        return training_flops_per_token(n_matmul, self.n_layers_total, self.args.n_heads * self.args.d_k, seq_len)


class DecoderLM(_TransformerModel):
    """Decoder-only (GPT-style) causal language model.

    ids -> embed·√C + PE -> dropout -> n_layers × DecoderLayer(causal, no cross-attention)
    -> final LayerNorm (pre-LN only; Xiong et al. 2020) -> lm_head -> logits. A Llama-style decoder
    (``presets/llama.toml``) is ids -> embed -> n_layers × DecoderLayer(RMSNorm, RoPE, GQA, SwiGLU; pre-norm)
    -> final RMSNorm -> lm_head, which is ``transformers``' ``LlamaForCausalLM`` (``hf_names.py`` maps the
    weights; with ``qk_norm`` ``Qwen3ForCausalLM``).

    Args:
        args: sizes and switches (``TransformerArgs``).

    Raises:
        ValueError: d_model % n_heads != 0 (without head_dim), n_kv_heads not dividing n_heads, unknown
        mlp/norm/position/attention; from forward, sequences longer than max_len.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__(args)
        sizes = (args.d_model, args.n_heads, args.d_ff)
        self.layers = nn.ModuleList(
            DecoderLayer(*sizes, cross_attention=False, **self._layer_kwargs(), **self._feed_forward(i))
            for i in range(args.n_layers)
        )
        self.final_norm = self._final_norm()
        self.lm_head = self._make_lm_head()
        self._reset_parameters()

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def checked_inputs(self, input_ids: Tensor, position_ids: Tensor | None = None) -> dict[str, Tensor | None]:
        """The forward's keyword arguments for a batch with its data-dependent checks done here, once, in eager
        mode: ``padding_mask`` (``padding_mask_of``) and, with ``position_ids``, ``document_mask``
        (``document_mask_of``; ``position_ids`` are dropped when the batch crosses no document boundary). A model
        compiled whole then runs them with no graph break and no host read (the trainer calls this outside the
        compiled region: a whole-model compile broke at every forward on the padding check, issue 49).

        Raises:
            ValueError: ``position_ids`` not of ``input_ids``' shape."""
        kwargs: dict[str, Tensor | None] = {"input_ids": input_ids,
                                            "padding_mask": padding_mask_of(input_ids, self.args.pad_id)}
        documents = documents_of(input_ids, position_ids)
        if position_ids is not None:
            kwargs.update(document_mask=documents.get("attn_mask"), **({"position_ids": position_ids}
                                                                        if documents else {}))
        return kwargs

    def forward(self, input_ids: Tensor, *, position_ids: Tensor | None = None, cache: KVCache | None = None,
                padding_mask: Tensor | None | str = CHECK, document_mask: Tensor | None | str = CHECK,
                return_hidden: bool = False) -> Tensor:
        """
        Args:
            input_ids: LongTensor (B, T) with T <= max_len (with ``cache``: cache.length + T <= max_len).
            position_ids: LongTensor (B, T), packed documents (``[data] document_mask``): each token's position in
                its document, restarting at 0 at every document start and at the window's first token. Attention
                is then block-causal (causal within a document, nothing across documents) and the positions
                (RoPE, or the sinusoidal table) are these: every document computes what it computes on its own
                (``document_mask_of``). The mask is built here, once, and handed to every block. A batch whose
                every row is 0 .. T - 1 runs exactly as without ``position_ids`` (SDPA's causal fast path).
            cache: incremental decoding (eval): ``KVCache.for_model(model)``, then the same object on every
                call, each feeding only the tokens after those already seen (positions continue from
                ``cache.length``). None (training): the whole sequence, as always.
            padding_mask, document_mask: ``CHECK`` (default): the model decides from the ids and positions (a host
                read each); else bool (B, T) / (B, 1, T, T) or None as ``checked_inputs`` decided them.
            return_hidden: return the final normalised hidden states (B, T, C) instead of the logits, for a loss
                that applies the output layer itself chunk by chunk (``training.loss_impl``,
                ``torch_handle.train.loss.chunked_loss_fn`` with ``lm_head.weight``).

        Returns:
            logits: (B, T, V) in the head's compute dtype (float32, or bf16/fp16 under autocast or a 16-bit
                model: the loss upcasts them chunk by chunk); position t predicts token t + 1. With
                ``return_hidden``: (B, T, C).

        Raises:
            ValueError: ``position_ids`` with a ``cache`` (packed documents are for training and evaluation), or
                not of ``input_ids``' shape.
        """
        if position_ids is not None and cache is not None:
            raise ValueError("position_ids (packed documents) cannot be combined with a key/value cache")
        # attn_mask (B, 1, T, T), position_ids (B, T), or none
        documents = documents_of(input_ids, position_ids, document_mask)
        x, padding_mask = self._decoder_input(input_ids, cache, documents.get("position_ids"),  # (B, T, C), ...
                                              padding_mask)
        for i, layer in enumerate(self.layers):
            x = self._run_block(f"decoder.layer{i}", layer, x, key_padding_mask=padding_mask,
                                **_layer_cache(cache, i), **documents, **self._rope())
        x = self.final_norm(x)
        if return_hidden:
            return x  # (B, T, C)
        # (B, T, V). No .float(): under autocast the head's output is already rounded to bf16, so an fp32 copy
        # would add no precision, only a pass over B·T·V elements; the loss upcasts per chunk.
        return self.lm_head(x)


class EncoderDecoder(_TransformerModel):
    """The original encoder-decoder Transformer (Vaswani et al. 2017, fig. 1), with one
    vocabulary shared by source and target (one embedding, also the output projection when
    tied, §3.4).

    Encoder: n_layers × EncoderLayer over the source, with a source padding mask.
    Decoder: n_layers × DecoderLayer (causal self-attention with target padding mask,
    cross-attention to the encoder output with the source padding mask, FFN).
    Pre-LN models add a final LayerNorm to each stack.

    Args:
        args: as for ``DecoderLM``; ``args.n_layers`` is per stack (2·n_layers layers in all).
        The paper's model is ``mlp="relu", norm_first=False``. Every option applies to both stacks; RoPE rotates
        the self-attentions (the cross-attention's queries and keys come from different sequences: no rotation).

    Raises:
        ValueError: as for ``DecoderLM``.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__(args)
        sizes = (args.d_model, args.n_heads, args.d_ff)
        self.encoder_layers = nn.ModuleList(EncoderLayer(*sizes, **self._layer_kwargs(), **self._feed_forward(i))
                                            for i in range(args.n_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(*sizes, cross_attention=True, **self._layer_kwargs(), **self._feed_forward(i))
            for i in range(args.n_layers)
        )
        self.encoder_norm = self._final_norm()
        self.decoder_norm = self._final_norm()
        self.lm_head = self._make_lm_head()
        self._reset_parameters()

    def blocks(self) -> list[nn.Module]:
        return [*self.encoder_layers, *self.decoder_layers]

    def checked_inputs(self, src_ids: Tensor, tgt_ids: Tensor) -> dict[str, Tensor | None]:
        """The forward's keyword arguments with both padding masks decided here, once per batch, in eager mode
        (``padding_mask_of``; see ``DecoderLM.checked_inputs``)."""
        pad = self.args.pad_id
        return {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_padding_mask": padding_mask_of(src_ids, pad),
                "tgt_padding_mask": padding_mask_of(tgt_ids, pad)}

    def encode(self, src_ids: Tensor, padding_mask: Tensor | None | str = CHECK) -> tuple[Tensor, Tensor | None]:
        """src_ids LongTensor (B, S) -> (memory (B, S, C), source padding mask bool (B, S) or None; ``padding_mask``
        as in ``DecoderLM.forward``)."""
        src_padding_mask = self._padding_mask(src_ids, padding_mask)  # (B, S) or None
        x = self._embed(src_ids)  # (B, S, C)
        for i, layer in enumerate(self.encoder_layers):
            x = self._run_block(f"encoder.layer{i}", layer, x, key_padding_mask=src_padding_mask, **self._rope())
        return self.encoder_norm(x), src_padding_mask

    def decode(self, tgt_ids: Tensor, memory: Tensor, src_padding_mask: Tensor | None = None, *,
               cache: KVCache | None = None, tgt_padding_mask: Tensor | None | str = CHECK) -> Tensor:
        """tgt_ids LongTensor (B, T), memory (B, S, C) -> logits (B, T, V) in the head's compute dtype (as in
        ``DecoderLM.forward``).

        ``cache`` (eval): incremental decoding as in ``DecoderLM.forward``; the cross-attention keys/values
        of ``memory`` are projected on the first call and reused (after ``cache.reorder`` too)."""
        x, tgt_padding_mask = self._decoder_input(tgt_ids, cache, None, tgt_padding_mask)  # (B, T, C), (B, P+T)
        for i, layer in enumerate(self.decoder_layers):
            x = self._run_block(f"decoder.layer{i}", layer, x, memory, key_padding_mask=tgt_padding_mask,
                                memory_key_padding_mask=src_padding_mask, **_layer_cache(cache, i), **self._rope())
        x = self.decoder_norm(x)
        return self.lm_head(x)  # (B, T, V)

    def forward(self, src_ids: Tensor, tgt_ids: Tensor, *, src_padding_mask: Tensor | None | str = CHECK,
                tgt_padding_mask: Tensor | None | str = CHECK) -> Tensor:
        """
        Args:
            src_ids: LongTensor (B, S), S <= max_len.
            tgt_ids: LongTensor (B, T), T <= max_len (teacher-forced decoder input).
            src_padding_mask, tgt_padding_mask: ``CHECK`` or ``checked_inputs``' decision (``DecoderLM.forward``).

        Returns:
            logits: (B, T, V) in the head's compute dtype (as in ``DecoderLM.forward``); position t predicts
                target token t + 1.
        """
        memory, src_padding_mask = self.encode(src_ids, src_padding_mask)  # (B, S, C)
        return self.decode(tgt_ids, memory, src_padding_mask, tgt_padding_mask=tgt_padding_mask)


def _layer_cache(cache: KVCache | None, i: int) -> dict[str, LayerCache]:
    """The keyword argument that hands decoder layer ``i`` its cache; none without a cache."""
    return {} if cache is None else {"cache": cache.layers[i]}


MODEL_KINDS: dict[ModelKind, type[_TransformerModel]] = {
    "decoder": DecoderLM,
    "encoder-decoder": EncoderDecoder,
}


def build_transformer(args: TransformerArgs, kind: ModelKind = "decoder") -> DecoderLM | EncoderDecoder:
    """Build the model ``kind`` names from ``args``.

    Args:
        args: sizes and switches (``TransformerArgs``).
        kind: ``"decoder"`` (``DecoderLM``) or ``"encoder-decoder"`` (``EncoderDecoder``).

    Raises:
        ValueError: for an unknown kind (the message lists the valid ones), plus anything the
        model's constructor raises.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(map(repr, MODEL_KINDS))}")
    return MODEL_KINDS[kind](args)
