"""The one constructor of a :class:`~torch_handle.data.datasets.DataBundle` from prepared token directories: what
the ``tokens``, ``text`` and ``pydoc`` datasets give a rank. Vocabulary, padding and end-of-document ids, the
tokenizer file and the data's identity all come from the directories' ``meta.json``
(:meth:`~torch_handle.data.shards.Prepared.identity`), nowhere else.
"""

from __future__ import annotations

import logging
from typing import Sequence

from torch_handle.data.datasets import DataBundle, TokenWindows
from torch_handle.data.shards import Prepared, mixture_identity, mixture_problems
from torch_handle.errors import DataError

log = logging.getLogger("torch_handle")


def prepared_bundle(sources: Sequence[tuple[str, Prepared, float]], seq_len: int, *, document_mask: bool = False,
                    description: str = "", mixture: bool = False, objective: str = "lm") -> DataBundle:
    """A bundle of ``seq_len`` windows (:class:`~torch_handle.data.datasets.TokenWindows`) over ``sources``
    (``(name, prepared directory, weight)``): the one directory's windows, or with ``mixture`` their weighted blend
    (:class:`~torch_handle.data.mixture.MixedWindows`; a source shorter than its share is upsampled, said in the
    log). ``objective`` ``"sft"``: the one directory's conversations packed, labels on their trained tokens only
    (:class:`~torch_handle.data.chat.packing.PackedConversations`); ``"dpo"``: its preference pairs, one sample each
    (:class:`~torch_handle.data.chat.pair_samples.PreferencePairs`).

    Raises:
        DataError: sources with different tokenizers; a split too short for one window; ``sft`` or ``dpo`` on a
            mixture, on data without trained-token masks; ``dpo`` on data without pairs.
    """
    from torch_handle.data.mixture import MixedWindows

    prepared = [p for _, p, _ in sources]
    if problems := mixture_problems(prepared):
        raise DataError("\n".join(problems))
    if objective in ("sft", "dpo"):
        return _conversation_bundle(prepared, seq_len, description, mixture, objective)
    splits = {}
    for split in ("train", "valid"):
        windows = [TokenWindows(getattr(p, split), seq_len, document_mask=document_mask,
                                name=f"{p.directory} ({split} split)") for _, p, _ in sources]
        splits[split] = MixedWindows(windows, [w for *_, w in sources], [n for n, *_ in sources]) if mixture \
            else windows[0]
    if mixture:
        mix = splits["train"]
        for j in mix.blend.upsampled():
            draws, length = int(mix.blend.draws()[j]), mix.blend.lengths[j]
            log.warning("data source %s: its share of the mixture (%d samples an epoch) is more than its %d samples: "
                        "it is upsampled (repeats %.2f times an epoch)", mix.names[j], draws, length, draws / length)
    identity = mixture_identity(prepared)
    return DataBundle(train=splits["train"], valid=splits["valid"], vocab_size=identity.vocab_size, max_len=seq_len,
                      tokenizer_path=prepared[0].tokenizer_path, pad_id=identity.pad_id, description=description,
                      identity=identity)


def _conversation_bundle(prepared: Sequence[Prepared], seq_len: int, description: str, mixture: bool,
                         objective: str) -> DataBundle:
    from torch_handle.data.chat.packing import PackedConversations
    from torch_handle.data.chat.pair_samples import PreferencePairs

    if mixture:
        raise DataError(f"data.sources: objective {objective} reads one prepared directory of conversations "
                        f"(data.path), not a mixture")
    data, identity = prepared[0], mixture_identity(list(prepared))
    kind = PreferencePairs if objective == "dpo" else PackedConversations
    splits = {split: kind(getattr(data, split), seq_len, fill_id=identity.eos_id,
                          name=f"{data.directory} ({split} split)") for split in ("train", "valid")}
    if objective == "dpo":
        log.info("data %s: %d pairs, each a sample of 2 x %d positions", data.directory, len(splits["train"]), seq_len)
    else:
        log.info("data %s: %d conversations packed into %d samples of %d positions (%.1f%% of them filled)",
                 data.directory, data.train.n_documents, len(splits["train"]), seq_len,
                 100 * splits["train"].efficiency)
    return DataBundle(train=splits["train"], valid=splits["valid"], vocab_size=identity.vocab_size, max_len=seq_len,
                      tokenizer_path=data.tokenizer_path, pad_id=identity.pad_id, description=description,
                      identity=identity)
