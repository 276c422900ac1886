"""EleutherAI's lm-evaluation-harness over handle's own model: :class:`HandleLM`, an ``lm_eval.api.model.LM``.

The harness turns every task into requests of three kinds and asks the model for their answers; this module
answers them with a ``DecoderLM`` and the run's ``tokenizers.Tokenizer`` exactly as the harness's ``hf`` model
(``lm_eval/models/huggingface.py``, ``HFLM``) answers them with the run's Hugging Face export, so that the scores
mean the same (``tests/test_lm_eval.py`` holds them equal):

- ``loglikelihood(context, continuation)`` -> (log P(continuation | context) in nats, whether greedy decoding
  would have produced the continuation). The pair is tokenized as ``TemplateLM._encode_pair`` does (the
  context's trailing spaces move to the continuation; the whole string is encoded and split at the context's
  length), an empty context is replaced by ``<bos>`` (``prefix_token_id``), and the input is left-truncated to
  ``max_length + 1`` tokens. Requests are sorted by length (longest first) and batched, right-padded (causal
  attention: padding after a token cannot change it); requests that differ only in a one-token continuation share
  one forward (the harness's ``Collator`` with ``group_by="contexts"``, as ``HFLM`` with its default
  ``logits_cache``).
- ``loglikelihood_rolling(text)`` -> the log-likelihood of the whole text (perplexity tasks): disjoint windows of
  ``max_length`` tokens, each scored given the tokens before it (``lm_eval.utils.get_rolling_token_windows``,
  the first predicted from ``<bos>``).
- ``generate_until(context, gen_kwargs)`` -> the continuation, greedy (``temperature`` 0 or ``do_sample`` false;
  a positive temperature samples), stopped at ``<eos>``, at the first stop sequence of ``until`` (cut off
  before it) or after ``max_gen_toks`` tokens (default 256). Decoding is cached (``KVCache``): one forward of the
  prompt, then one token per step; requests with the same gen_kwargs share a batch, left-padded under RoPE (a
  shift of every position changes no attention score), of one prompt length under absolute positions.

Shapes: B requests in a batch, T tokens, V the vocabulary. The model runs in its own dtype on its device, fp32
for ``load_run``'s models; log-softmax is computed in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from torch_handle.data.datasets import BOS_ID, EOS_ID, PAD_ID
from torch_handle.errors import DataError
from torch_handle.infer.generate import next_token
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.transformer import DecoderLM

BOS_TEXT = "<bos>"
DEFAULT_MAX_GEN_TOKS = 256
"""``HFLM.max_gen_toks``: the longest generation when a task gives no ``max_gen_toks``."""


class HandleLM(TemplateLM):
    """An ``lm_eval.api.model.LM`` answering the harness's requests with a handle decoder.

    Args:
        model: a ``DecoderLM`` (eval mode; MoE, LoRA/QLoRA adapters applied unmerged: whatever ``load_run``
            built). Its ``args.max_len`` is the harness's ``max_length``.
        tokenizer: the run's ``tokenizers.Tokenizer`` (``tokenizer.json``), whose special tokens are numbered as
            ``torch_handle.data.datasets`` numbers them: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3.
        batch_size: requests per forward (loglikelihood windows, generation rows).
        seed: of the sampler when a task asks for sampling (``do_sample``).
        group: a ``torch.distributed`` process group whose ranks share the work (in-loop evaluation over the
            data-parallel ranks, :mod:`torch_handle.train.eval_tasks`): the harness gives rank r of W the documents
            r, r + W, ... of each task (``Task.build_all_requests``), pads the ranks to the same number of requests,
            gathers the per-document metrics on the group's rank 0 (:meth:`gather_object`) and computes the scores
            there; None: one process scores everything.
    """

    backend = "causal"

    def __init__(self, model: DecoderLM, tokenizer: Any, batch_size: int = 16, seed: int = 1234,
                 group: Any = None) -> None:
        super().__init__()
        if not isinstance(model, DecoderLM):
            raise TypeError(f"HandleLM needs a DecoderLM, got {type(model).__name__}")
        self.model, self.tokenizer = model, tokenizer
        self.group = group
        if group is not None:
            self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        self.batch_size = max(1, int(batch_size))
        self._device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.relative = getattr(model.args, "position", None) == "rope"
        """Positions enter attention only as differences (RoPE): generation may batch left-padded prompts."""
        self.counts: dict[str, int] = {}
        """Requests answered, by type (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``)."""
        self.counts_per_rank: list[dict[str, int]] = [self.counts]
        """With a group, on its rank 0 after the harness gathered the metrics: every rank's :attr:`counts`."""

    # ------------------------------------------------------------------------ the harness's collectives (group)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (a count: shape ()), stacked in rank order: (W,) -- (W·n, ...) for (n, ...)."""
        if self.group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on the group's rank ``dst`` (a list in rank order), None on the others. Each rank's
        :attr:`counts` travel with it (:attr:`counts_per_rank` on ``dst``): the harness's last collective carries
        them, so nothing collective follows the scores' computation on ``dst`` alone (which may raise)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object((obj, dict(self.counts)), out, dst=dist.get_global_rank(self.group, dst), group=self.group)
        if out is None:
            return None
        self.counts_per_rank = [counts for _, counts in out]
        return [o for o, _ in out]

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _agreed(self, answer: Any) -> Any:
        """``answer()`` on every rank of the group, an error on any rank raised on all: a rank that failed alone
        (its share held a continuation too long for the model) would leave the others waiting in the harness's next
        collective. One ``all_gather_object`` of each rank's error (or None) per request type.

        Raises:
            Exception: this rank's own error; else DataError naming the first rank that failed and its error."""
        if self.group is None:
            return answer()
        out, error = None, None
        try:
            out = answer()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks have heard of it
            error = e
        errors: list[Any] = [None] * self.world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}", group=self.group)
        if error is not None:
            raise error
        failed = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
        if failed is not None:
            raise DataError(f"rank {failed[0]} of the evaluation failed: {failed[1]}")
        return out

    def _count(self, kind: str, requests: list[Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + len(requests)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return self._device

    # -------------------------------------------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        """``<eos>``: the end of a generation (``HFLM``: the tokenizer's eos_token_id)."""
        return EOS_ID

    @property
    def prefix_token_id(self) -> int:
        """``<bos>``: the context of a continuation scored without one (``HFLM``: the tokenizer's bos_token_id)."""
        return BOS_ID

    @property
    def max_length(self) -> int:
        """Tokens the model reads at once: its ``max_len`` (the export's ``max_position_embeddings``)."""
        return int(self.model.args.max_len)

    @property
    def tokenizer_name(self) -> str:
        return "handle"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string``: the tokenizer's own post-processing unless ``add_special_tokens`` is False or
        the string starts with ``<bos>`` (``HFLM.tok_encode``)."""
        special = add_special_tokens if add_special_tokens is not None else not string.startswith(BOS_TEXT)
        ids = self.tokenizer.encode(string, add_special_tokens=special).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------ log-likelihood
    @torch.no_grad()
    def _log_probs(self, rows: list[list[int]], spans: list[int]) -> list[torch.Tensor]:
        """Right-padded rows (B, T) through the model -> for each row the log-softmax (fp32) at its last ``spans[i]``
        positions, (spans[i], V). No padding mask: under causal attention a position never sees the padding after
        it (``HFLM`` calls its model the same way). The output layer and the softmax run on those positions alone
        (``return_hidden``): the context's logits are never needed."""
        width = max(map(len, rows))
        ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], device=self.device)
        hidden = self.model(ids, padding_mask=None, return_hidden=True)  # (B, T, C)
        picked = torch.cat([hidden[i, len(r) - n:len(r)] for i, (r, n) in enumerate(zip(rows, spans))])  # (ΣN, C)
        log_probs = F.log_softmax(self.model.lm_head(picked).float(), dim=-1)  # (ΣN, V)
        return list(log_probs.split(spans))

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Each request's ``(context, continuation)`` -> (log P(continuation | context) in nats, is greedy)."""
        self._count("loglikelihood", requests)
        parent = super().loglikelihood
        return self._agreed(lambda: parent(requests, disable_tqdm=True))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(request, context ids, continuation ids) -> (sum of the continuation's log-probabilities in nats, every
        continuation token the argmax), in the order of ``requests``."""
        def by_length(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        order = Collator(requests, sort_fn=by_length, group_by="contexts", group_fn=lambda req: req[-2] + req[-1][:-1])
        out: list[tuple[float, bool]] = []
        for chunk in order.get_batched(n=self.batch_size):
            for _, _, cont in chunk:
                if len(cont) > self.max_length:  # HFLM asserts the same
                    raise DataError(f"a continuation of {len(cont)} tokens does not fit the model's "
                                    f"{self.max_length} positions (a task for a longer model)")
            rows = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            for (request, ctx, cont), lp in zip(chunk, self._log_probs(rows, [len(c) for _, _, c in chunk])):
                lp = lp.unsqueeze(0)  # (1, len(cont), V)
                greedy = lp.argmax(-1)  # (1, len(cont))
                for request, cont, lp_ in order.get_cache(req_str=request, cxt_toks=ctx, cont_toks=cont, logits=lp):
                    target = torch.tensor(cont, device=self.device).unsqueeze(0)  # (1, n)
                    is_greedy = bool((greedy[:, -target.shape[1]:] == target).all())
                    picked = torch.gather(lp_, 2, target.unsqueeze(-1)).squeeze(-1)  # (1, n)
                    out.append((float(picked.sum()), is_greedy))
        return order.get_original(out)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each request's ``(text,)`` -> log P(text) in nats, summed over disjoint windows of ``max_length``."""
        self._count("loglikelihood_rolling", requests)
        return self._agreed(lambda: self._rolling(requests))

    def _rolling(self, requests: list[Any]) -> list[float]:
        windows, counts = [], []
        for (text,) in (req.args for req in requests):
            mine = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, ctx, cont) for ctx, cont in mine]
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for n in counts:
            out.append(sum(s for s, _ in scores[at:at + n]))
            at += n
        return out

    # ------------------------------------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's ``(context, gen_kwargs)`` -> the generated text up to its first stop sequence."""
        self._count("generate_until", requests)
        return self._agreed(lambda: self._generate_all(requests))

    def _generate_all(self, requests: list[Any]) -> list[str]:
        encoded = {}

        def by_length(req):
            if req[0] not in encoded:
                encoded[req[0]] = self.tok_encode(req[0])
            return -len(encoded[req[0]]), req[0]

        order = Collator([req.args for req in requests], sort_fn=by_length, group_by="gen_kwargs",
                         group_fn=lambda req: req[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out: list[str] = []
        for chunk in order.get_batched(n=0):  # one gen_kwargs group at a time, longest prompts first
            kwargs = normalize_gen_kwargs(chunk[0][1], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise DataError(f"max_gen_toks {max_new} leaves no room for a prompt in the model's "
                                f"{self.max_length} positions (a task for a longer model)")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            prompts = [self.tok_encode(context, left_truncate_len=self.max_length - max_new) for context, _ in chunk]
            start = 0
            while start < len(prompts):  # longest first; RoPE: any lengths, left-padded; else one length a batch
                end = start + 1
                while (end < len(prompts) and end - start < self.batch_size
                       and (self.relative or len(prompts[end]) == len(prompts[start]))):
                    end += 1
                for ids in self._generate(prompts[start:end], max_new, until, temperature):
                    out.append(postprocess_generated_text(self.tok_decode(ids), until, None))
                start = end
        return order.get_original(out)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], max_new: int, until: list[str],
                  temperature: float) -> list[list[int]]:
        """Prompts (B of them, T tokens the longest) -> the generated ids of each (stopped at ``<eos>``, left out,
        or once its text holds a stop sequence). Shorter prompts are left-padded, the padding masked: their tokens
        sit at positions shifted by the padding, which RoPE does not see (attention scores depend on positions'
        differences alone); the caller batches prompts of one length for absolute positions."""
        cache = KVCache.for_model(self.model)
        width = max(map(len, prompts))
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device=self.device)  # (B, T)
        pads = torch.tensor([[True] * (width - len(p)) + [False] * len(p) for p in prompts], device=self.device)
        hidden = self.model(ids, cache=cache, padding_mask=pads if bool(pads.any()) else None,
                            return_hidden=True)  # (B, T, C): the output layer on the last position alone
        logits = self.model.lm_head(hidden[:, -1])  # (B, V)
        out: list[list[int]] = [[] for _ in prompts]
        rows = list(range(len(prompts)))  # which prompt each live row is
        stops = [s for s in until if s]
        for _ in range(max_new):
            tokens = next_token(logits.float(), temperature, 0, self.generator)  # (B',)
            keep = []
            for j, (row, token) in enumerate(zip(rows, tokens.tolist())):
                if token == EOS_ID:
                    continue
                out[row].append(token)
                if not any(s in self.tok_decode(out[row][-64:], skip_special_tokens=False) for s in stops):
                    keep.append(j)
            if not keep or cache.length >= self.max_length:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache.reorder(index)
                tokens = tokens[index]
                rows = [rows[j] for j in keep]
            logits = self.model(tokens[:, None], cache=cache, padding_mask=None)[:, -1]  # (B', V)
        return out
