"""Use a trained run: load its model and tokenizer, sample text, translate (greedy / beam search), evaluate.

- :func:`load_run` builds the run's model from ``preset.toml`` through the model plugin, with the vocabulary of
  ``tokenizer.json`` and the positional-table length of the weights, and loads ``model.safetensors`` or, with
  ``checkpoint=STEP``, ``checkpoints/step-STEP/model.pt`` (strategies ``single``, ``ddp``, ``scratch-ddp``) or
  ``dcp/`` (``fsdp``, consolidated in this process); DeepSpeed's ``ds/`` is refused (use model.safetensors).
- :func:`sample` streams tokens from a ``DecoderLM`` with a key/value cache (``torch_handle.model.kv_cache.KVCache``):
  each step feeds only the new token.
- :func:`greedy_translate` and :func:`beam_translate` decode an ``EncoderDecoder`` in batches, also cached.
  Beam search ranks finished hypotheses by log P(Y|X) / lp(Y) with the GNMT length penalty
  lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, §7; alpha = 0 is the raw log-probability) and stops a sentence
  once it has ``beam`` finished hypotheses, taking ``<eos>`` only among the ``beam`` best candidates of a step
  (as fairseq does), so beam 1 is exactly greedy decoding.
- :func:`evaluate_loss`, :func:`bleu_chrf`: token-mean cross-entropy / perplexity and sacrebleu's corpus BLEU and
  chrF on detokenized text (Post 2018, "A Call for Clarity in Reporting BLEU Scores").

Every problem a user can fix raises one of ``torch_handle.errors.USER_ERRORS`` (one line).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from torch_handle.common.names import TOKENIZER_FILE
from torch_handle.checkpoint.hf_dir import load_into
from torch_handle.checkpoint.store import list_checkpoints, safe_load, verify
from torch_handle.finetune.build import prepare_model
from torch_handle.data.datasets import BOS_ID, EOS_ID, IGNORE_INDEX, PAD_ID, DataContext, TranslationDataset
from torch_handle.errors import CheckpointError, DataError, RunDirError
from torch_handle.model.kv_cache import KVCache
from torch_handle.model.transformer import DecoderLM, EncoderDecoder
from torch_handle.rundir import PRESET_FILE, read_run_info

WEIGHTS_FILE = "model.safetensors"
_OTHER_FORMATS = {"ds": "DeepSpeed checkpoint (ds/): use the run's model.safetensors"}


@dataclass
class LoadedRun:
    """A run's model (eval mode, fp32, on ``device``), tokenizer and preset."""

    run_dir: Path
    model: DecoderLM | EncoderDecoder
    tokenizer: Any
    """A ``tokenizers.Tokenizer``."""
    preset: Any
    """The run's ``torch_handle.config.loader.Preset``."""
    weights: Path
    """The file the weights came from."""

    @property
    def kind(self) -> str:
        """``"decoder"`` or ``"encoder-decoder"``."""
        return "encoder-decoder" if isinstance(self.model, EncoderDecoder) else "decoder"


def _weights_path(run_dir: Path, checkpoint: int | None) -> Path:
    if checkpoint is None:
        path = run_dir / WEIGHTS_FILE
        if not path.is_file():
            steps = [p.name.split("-", 1)[1] for p in list_checkpoints(run_dir / "checkpoints")]
            hint = f"; checkpoints: {', '.join(steps)} (use --checkpoint STEP)" if steps else ""
            raise CheckpointError(f"{run_dir}: no {WEIGHTS_FILE} (the run has not finished){hint}")
        return path
    step_dir = run_dir / "checkpoints" / f"step-{checkpoint}"
    if not step_dir.is_dir():
        steps = [p.name.split("-", 1)[1] for p in list_checkpoints(run_dir / "checkpoints")]
        raise CheckpointError(f"{step_dir}: no such checkpoint (available: {', '.join(steps) or 'none'})")
    verify(step_dir, checksums=False)
    for name in ("model.pt", "dcp"):
        if (step_dir / name).exists():
            return step_dir / name
    for sub, message in _OTHER_FORMATS.items():
        if (step_dir / sub).exists():
            raise CheckpointError(f"{step_dir}: {message}")
    raise CheckpointError(f"{step_dir}: no model.pt or dcp/ (supported: single, ddp, scratch-ddp and fsdp "
                          "checkpoints)")


def _read_weights(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: cannot be read ({' '.join(str(e).split())})") from None
    if path.name == "dcp":  # FSDP's sharded torch.distributed.checkpoint: consolidated in one process
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            try:  # reads dcp's pickled .metadata, as the fsdp strategy's own resume does
                dcp_to_torch_save(str(path), Path(tmp) / "full.pt")
            except Exception as e:  # noqa: BLE001 - dcp raises CheckpointException and others
                raise CheckpointError(f"{path}: cannot be read ({type(e).__name__})") from None
            state = safe_load(Path(tmp) / "full.pt").get("model")
    else:
        state = safe_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a state dict")
    return state


def _max_len(state: dict[str, Tensor], preset: Any, weights: Path) -> int:
    """The model's max_len: the sinusoidal table's length, or for a RoPE model (no table) the length its data
    gave it: ``data.seq_len``, + 1 for translation (``<bos>`` before the target)."""
    pe = state.get("pos_encoding.pe")
    if pe is not None:
        return int(pe.shape[0])
    options = preset.model.options
    seq_len = getattr(preset.data.options, "seq_len", None)
    if getattr(options, "position", None) != "rope" or not isinstance(seq_len, int):
        raise CheckpointError(f"{weights}: no pos_encoding.pe (not weights of the transformer model plugin)")
    return seq_len + (1 if getattr(options, "kind", "decoder") == "encoder-decoder" else 0)


class OpenedRun:
    """A run directory opened once for every command that uses it (export, generate, chat, eval): each of its files
    is read at most once, when first asked for, and handed down (issue 50, "one loaded run").

    Attributes (each read on first use): :attr:`preset` (``preset.toml``), :attr:`tokenizer`
    (``tokenizer.json``), :attr:`weights` (the file of the final weights or of ``checkpoint``), :attr:`step` (the
    checkpoint's, or the one the final weights' metadata records), :attr:`template` (a conversation run's chat
    template, or None); :meth:`load` builds the model (adapters applied) once.

    Args:
        run_dir: a directory ``handle run`` created.
        checkpoint: a step of ``checkpoints/``; None: the final ``model.safetensors``.

    Raises:
        RunDirError: not a run directory (no ``preset.toml``).
    """

    def __init__(self, run_dir: Path | str, checkpoint: int | None = None):
        self.run_dir, self.checkpoint = Path(run_dir), checkpoint
        if not (self.run_dir / PRESET_FILE).is_file():
            raise RunDirError(f"{self.run_dir}: not a run directory (no {PRESET_FILE})")
        self._loaded: dict[str, LoadedRun] = {}

    @functools.cached_property
    def preset(self) -> Any:
        """The run's ``Preset``. Raises PresetError: it no longer validates (a plugin is missing)."""
        from torch_handle.config.loader import load_preset

        return load_preset(self.run_dir / PRESET_FILE)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The run's ``tokenizers.Tokenizer``. Raises RunDirError: no ``tokenizer.json``, or an unreadable one."""
        from tokenizers import Tokenizer

        path = self.run_dir / TOKENIZER_FILE
        if not path.is_file():
            raise RunDirError(f"{self.run_dir}: no {TOKENIZER_FILE} (the run stopped before its data was built)")
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception type
            raise RunDirError(f"{path}: unreadable ({' '.join(str(e).split())})") from None

    @functools.cached_property
    def weights(self) -> Path:
        """The weights' file. Raises CheckpointError: none, or an unsupported checkpoint format."""
        return _weights_path(self.run_dir, self.checkpoint)

    @functools.cached_property
    def step(self) -> int | None:
        """The step the weights are from: the checkpoint's, else the ``step`` the final weights' metadata holds."""
        if self.checkpoint is not None:
            return self.checkpoint
        from safetensors import safe_open

        with safe_open(str(self.weights), "pt") as f:
            step = (f.metadata() or {}).get("step")
        return int(step) if step and step.isdigit() else None

    @functools.cached_property
    def template(self) -> Any:
        """A run fine-tuned on conversations: its chat template (``data.chat.template.ChatTemplate``, as
        ``torch_handle.infer.chat.run_template`` reads it); None for other runs."""
        from torch_handle.data.chat.template import TEMPLATE_FILE, load_template

        if not (self.run_dir / TEMPLATE_FILE).is_file():
            return None
        return load_template(None, self.run_dir / TOKENIZER_FILE)

    def load(self, device: str | torch.device = "cpu") -> LoadedRun:
        """The run's model (eval mode, fp32) on ``device``, built once per device; the tokenizer file is checked
        before anything is read.

        Raises:
            RunDirError: no or an unreadable run.json, no tokenizer.json, a model that is not the project's
                Transformer.
            PresetError: the run's preset.toml no longer validates.
            CheckpointError: no weights, an unsupported checkpoint format, or weights that do not fit the model.
        """
        key = str(device)
        if key in self._loaded:
            return self._loaded[key]
        from torch_handle.registry import get_registry

        read_run_info(self.run_dir)
        if not (self.run_dir / TOKENIZER_FILE).is_file():
            raise RunDirError(f"{self.run_dir}: no {TOKENIZER_FILE} (the run stopped before its data was built)")
        weights, preset, tokenizer = self.weights, self.preset, self.tokenizer
        state = _read_weights(weights)
        factory = get_registry().get("model", preset.model.name).factory
        with torch.random.fork_rng(devices=[]):  # the run's initial weights: a LoRA run without init_from froze them
            torch.manual_seed(preset.run.seed)
            model = factory(preset.model.options, tokenizer.get_vocab_size(), PAD_ID, _max_len(state, preset, weights))
        if not isinstance(model, (DecoderLM, EncoderDecoder)):
            raise RunDirError(f"{self.run_dir}: model {preset.model.name!r} is not the project's Transformer")
        prepare_model(model, preset, new_run=False, load_base=load_into)  # LoRA: the frozen base, then the adapters
        try:
            model.load_state_dict({k: v.float() for k, v in state.items()})
        except RuntimeError as e:
            first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
            raise CheckpointError(f"{weights}: does not fit the run's model ({first})") from None
        self._loaded[key] = LoadedRun(self.run_dir, model.to(device).eval(), tokenizer, preset, weights)
        return self._loaded[key]


def load_run(run_dir: Path | str, checkpoint: int | None = None, device: str | torch.device = "cpu") -> LoadedRun:
    """Load a run directory's model, tokenizer and preset (:meth:`OpenedRun.load` of a run opened for it alone).

    Args:
        run_dir: a directory ``handle run`` created.
        checkpoint: a step of ``checkpoints/``; None: the final ``model.safetensors``.
        device: where the model goes.

    Raises:
        RunDirError: not a run directory, or no tokenizer.json.
        PresetError: the run's preset.toml no longer validates (a plugin is missing).
        CheckpointError: no weights, an unsupported checkpoint format, or weights that do not fit the model.
    """
    return OpenedRun(run_dir, checkpoint).load(device)


# ---------------------------------------------------------------------------------------------------------------
# Decoder-only: sampling
# ---------------------------------------------------------------------------------------------------------------


def next_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> LongTensor (B,): argmax when temperature is 0, else a draw from softmax(logits / T)
    restricted to the top_k most likely tokens (top_k 0: all)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(model: DecoderLM, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int = 0, generator: torch.Generator | None = None) -> Iterator[int]:
    """Yield ``max_new_tokens`` token ids continuing ``prompt`` (an empty prompt starts after ``<eos>``).

    Cached: the prompt is fed once, then one token per step. When the positional table is full the cache is
    rebuilt from the last half of the context (a sliding window).
    """
    device = next(model.parameters()).device
    context = list(prompt) or [EOS_ID]
    max_len = model.args.max_len
    context = context[-max_len:]
    cache = KVCache.for_model(model)
    logits = model(torch.tensor([context], device=device), cache=cache)[:, -1]  # (1, V)
    for _ in range(max_new_tokens):
        token = int(next_token(logits, temperature, top_k, generator))
        yield token
        context.append(token)
        if cache.length >= max_len:
            context = context[-(max_len // 2):]
            cache = KVCache.for_model(model)
            logits = model(torch.tensor([context], device=device), cache=cache)[:, -1]
        else:
            logits = model(torch.tensor([[token]], device=device), cache=cache)[:, -1]


class StreamDecoder:
    """Turns token ids into text pieces as they arrive: holds back bytes that do not yet form a complete UTF-8
    character (byte-level BPE splits characters across tokens); ``<eos>`` (a paragraph or document boundary in
    the LM datasets) becomes a blank line."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def push(self, token: int) -> str:
        if token == EOS_ID:
            return self.flush() + "\n\n"
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending, skip_special_tokens=True)
        if text.endswith("\ufffd") and len(self.pending) < 4:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        text = self.tokenizer.decode(self.pending, skip_special_tokens=True) if self.pending else ""
        self.pending = []
        return text


# ---------------------------------------------------------------------------------------------------------------
# Encoder-decoder: greedy and beam search
# ---------------------------------------------------------------------------------------------------------------


def _source_batch(sources: Sequence[Sequence[int]], max_len: int, device) -> Tensor:
    """Token lists -> (B, S) right-padded with ``<pad>``, each ``tokens[:max_len - 1] + <eos>`` as in training."""
    rows = [list(s)[: max_len - 1] + [EOS_ID] for s in sources]
    width = max(map(len, rows))
    return torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], device=device)


@torch.no_grad()
def greedy_translate(model: EncoderDecoder, sources: Sequence[Sequence[int]], max_len: int) -> list[list[int]]:
    """Greedy decoding of a batch: the most likely next token until ``<eos>`` or ``max_len`` target tokens.

    Returns the target token ids of each source (without ``<bos>``/``<eos>``)."""
    device = next(model.parameters()).device
    src = _source_batch(sources, model.args.max_len, device)  # (B, S)
    memory, src_mask = model.encode(src)  # (B, S, C), (B, S)
    max_len = min(max_len, model.args.max_len - 1)
    cache = KVCache.for_model(model)
    out: list[list[int]] = [[] for _ in sources]
    rows = torch.arange(len(sources), device=device)  # which source each live row is
    tokens = torch.full((len(sources), 1), BOS_ID, device=device)
    for _ in range(max_len):
        logits = model.decode(tokens, memory, src_mask, cache=cache)[:, -1]  # (B', V)
        best = logits.argmax(-1)  # (B',)
        live = best != EOS_ID
        for r, t in zip(rows[live].tolist(), best[live].tolist()):
            out[r].append(t)
        if not bool(live.any()):
            break
        keep = live.nonzero().squeeze(1)
        if len(keep) < len(rows):
            cache.reorder(keep)
            memory, src_mask = memory[keep], None if src_mask is None else src_mask[keep]
            rows = rows[keep]
        tokens = best[keep][:, None]
    return out


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, eq. 14); |Y| counts ``<eos>``."""
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_translate(model: EncoderDecoder, sources: Sequence[Sequence[int]], max_len: int, beam: int = 4,
                   alpha: float = 0.6) -> list[list[int]]:
    """Beam search over a batch of sources; the best hypothesis of each by log P / ``length_penalty``.

    Rows are (source, beam) pairs, B·K of them; every step scores the K·V continuations of each source,
    takes the 2K best, finishes those among the K best that end in ``<eos>`` and keeps the best K others
    alive. A source is done when it has K finished hypotheses (or at ``max_len``: its live beams count as
    finished). Beam 1 is greedy decoding.

    Returns the target token ids of each source (without ``<bos>``/``<eos>``)."""
    device = next(model.parameters()).device
    B, K = len(sources), beam
    src = _source_batch(sources, model.args.max_len, device)  # (B, S)
    memory, src_mask = model.encode(src)  # (B, S, C)
    rep = torch.arange(B, device=device).repeat_interleave(K)  # (B·K,) row -> source
    memory, src_mask = memory[rep], None if src_mask is None else src_mask[rep]
    max_len = min(max_len, model.args.max_len - 1)
    cache = KVCache.for_model(model)
    scores = torch.zeros(B, K, device=device)  # cumulative log-probabilities of the live beams
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    hyps: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    live = list(range(B))  # sources still searched, in row-block order
    tokens = torch.full((B * K, 1), BOS_ID, device=device)
    for step in range(max_len):
        logp = torch.log_softmax(model.decode(tokens, memory, src_mask, cache=cache)[:, -1], -1)  # (L·K, V)
        V = logp.shape[-1]
        total = (scores[:, :, None] + logp.view(len(live), K, V)).view(len(live), K * V)
        top_s, top_i = total.topk(min(2 * K, K * V), dim=-1)  # (L, 2K)
        new_scores = torch.full((len(live), K), float("-inf"), device=device)
        rows, next_tokens, still = [], [], []
        for j, b in enumerate(live):
            new_hyps = []
            for rank, (s, i) in enumerate(zip(top_s[j].tolist(), top_i[j].tolist())):
                k, tok = divmod(i, V)
                if s == float("-inf"):
                    break
                if tok == EOS_ID:
                    if rank < K:
                        finished[b].append((s / length_penalty(step + 1, alpha), hyps[b][k]))
                    continue
                new_hyps.append((s, k, tok))
                if len(new_hyps) == K:
                    break
            if len(finished[b]) >= K or not new_hyps:
                continue
            if step == max_len - 1:
                finished[b].extend((s / length_penalty(step + 1, alpha), hyps[b][k] + [t]) for s, k, t in new_hyps)
                continue
            while len(new_hyps) < K:  # fewer than K continuations (tiny vocabularies): pad with dead beams
                new_hyps.append((float("-inf"), new_hyps[0][1], new_hyps[0][2]))
            old = hyps[b]
            hyps[b] = [old[k] + [t] for _, k, t in new_hyps]
            for slot, (s, k, t) in enumerate(new_hyps):
                new_scores[j, slot] = s
                rows.append(j * K + k)
                next_tokens.append(t)
            still.append(j)
        if not still:
            break
        index = torch.tensor(rows, device=device)
        cache.reorder(index)
        memory, src_mask = memory[index], None if src_mask is None else src_mask[index]
        scores = new_scores[torch.tensor(still, device=device)]
        live = [live[j] for j in still]
        tokens = torch.tensor(next_tokens, device=device)[:, None]
    return [max(f, key=lambda x: x[0])[1] if f else [] for f in finished]


def translate(model: EncoderDecoder, tokenizer: Any, texts: Sequence[str], *, beam: int = 4, alpha: float = 0.6,
              max_len: int = 128, batch_size: int = 32) -> list[str]:
    """Translate ``texts`` (one sentence each); returns the detokenized translations in the same order.
    Sources are batched by length; ``beam`` 1 is greedy decoding."""
    ids = [e.ids for e in tokenizer.encode_batch(list(texts))]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = [ids[i] for i in chunk]
        hyps = (greedy_translate(model, batch, max_len) if beam == 1
                else beam_translate(model, batch, max_len, beam, alpha))
        for i, text in zip(chunk, tokenizer.decode_batch(hyps, skip_special_tokens=True)):
            out[i] = text.strip()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_loss(model: DecoderLM | EncoderDecoder, dataset, collate_fn: Callable | None = None,
                  batch_size: int = 16) -> tuple[float, int]:
    """Token-mean cross-entropy (nats) over every label of ``dataset`` (items as the dataset plugins build them:
    ``input_ids``/``labels`` or ``src_ids``/``tgt_ids``/``labels``) and the number of tokens counted."""
    from torch.utils.data import DataLoader

    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn):
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch)  # (B, T, V)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                                reduction="sum")
        total += float(nll)
        count += int((labels != IGNORE_INDEX).sum())
    if not count:
        raise DataError("the evaluation split has no tokens")
    return total / count, count


def validation_split(loaded: LoadedRun):
    """The run's validation dataset exactly as its dataset plugin builds it (the cache beside the run directory,
    :func:`torch_handle.data.cache.cache_root`; prepared again if it is gone). Returns (dataset, collate_fn).

    Raises:
        DataError: the data is gone or changed (its tokenizer differs from the run's tokenizer.json).
    """
    from tokenizers import Tokenizer

    from torch_handle.registry import get_registry

    from torch_handle.data.cache import cache_root

    p = loaded.preset
    plugin, cache = get_registry().get("dataset", p.data.name), cache_root(loaded.run_dir.parent)
    if plugin.prepare is not None:  # what the launcher did before the run (text, pydoc: their shards)
        plugin.prepare(p.data.options, cache, None)
    ctx = DataContext(cache_dir=cache, is_main=True, barrier=lambda: None, objective=p.finetune.objective)
    bundle = plugin.factory(p.data.options, ctx)
    if bundle.tokenizer_path is not None:
        built = Tokenizer.from_file(str(bundle.tokenizer_path)).get_vocab()
        if built != loaded.tokenizer.get_vocab():
            raise DataError(f"{loaded.run_dir}: the data of data.{p.data.name} changed since the run "
                            "(its tokenizer differs from the run's tokenizer.json)")
    return bundle.valid, bundle.collate_fn


def parallel_files(options: Any, split: str) -> tuple[Path, Path]:
    """The source and target files of ``split`` for a ``parallel`` dataset: ``data.<split>_path`` when the options
    have one (a directory with <split>.<src>), else ``<split>.<src>``/``.<tgt>`` in data.path; for ``test`` also
    Multi30k's original names ``test2016.*`` and ``test_2016_flickr.*``; ``valid`` also ``val.*``.

    Raises:
        DataError: when none exists.
    """
    root = Path(getattr(options, f"{split}_path", "") or options.path)
    names = {"valid": ["valid", "val"], "test": ["test", "test2016", "test_2016_flickr"]}.get(split, [split])
    for name in names:
        src, tgt = root / f"{name}.{options.src_lang}", root / f"{name}.{options.tgt_lang}"
        if src.is_file() and tgt.is_file():
            return src, tgt
    tried = ", ".join(f"{n}.{options.src_lang}" for n in names)
    raise DataError(f"{root}: no {split} split ({tried} with .{options.tgt_lang})")


def translation_dataset(tokenizer: Any, src: list[str], tgt: list[str], seq_len: int) -> TranslationDataset:
    """Sentence pairs built as the ``parallel`` plugin builds its splits."""
    return TranslationDataset([e.ids for e in tokenizer.encode_batch(src)],
                              [e.ids for e in tokenizer.encode_batch(tgt)], seq_len)


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """sacrebleu corpus BLEU (13a tokenization, exp smoothing) and chrF (character 6-grams, beta 2) of detokenized
    hypotheses against one reference each, with their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    return math.exp(loss) if loss < 700 else float("inf")
