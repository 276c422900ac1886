"""The ``tokens`` dataset's mixtures (torch_handle/data/mixture.py, plugins/tokens.py) on three real prepared sources
(Tiny Shakespeare, WikiText-2, Multi30k; one byte-level BPE): the realised shares, the blend's order, the same
samples at any world size, and the per-source telemetry (torch_handle/observe/data_mix.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from handle_plugins.tokens import TokensConfig, build
from tests.prepared_data import three_sources
from torch_handle.data.datasets import DataContext, GlobalBatchSampler
from torch_handle.data.mixture import Blend, blend_period, integer_weights
from torch_handle.observe.data_mix import step_source_tokens

WEIGHTS = {"shakespeare": 0.5, "wiki": 0.3, "captions": 0.2}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return three_sources(tmp_path_factory.mktemp("mix"))


def _bundle(dirs, tmp_path, **options):
    sources = [{"path": str(dirs[name]), "weight": w} for name, w in WEIGHTS.items()]
    opts = TokensConfig(sources=sources, seq_len=32, **options)
    return build(opts, DataContext(cache_dir=tmp_path, is_main=True, barrier=lambda: None))


def test_three_sources_give_their_weights_within_one_percent_over_10000_samples(dirs, tmp_path) -> None:
    train = _bundle(dirs, tmp_path).train
    sampler = GlobalBatchSampler(len(train), micro_batch_size=10_000, seed=7)
    indices = next(iter(sampler))  # 10,000 samples of the shuffled global order, as training draws them
    shares = np.bincount(train.source_of(indices), minlength=3) / len(indices)
    for (name, weight), share in zip(WEIGHTS.items(), shares):
        assert abs(share - weight) <= 0.01, (name, share, weight)
    # and the samples are the sources' windows: each item is exactly the window its source would give
    for i in random.Random(0).sample(range(len(train)), 50):
        source, window = train.blend.locate(np.array([i]))
        want = train.sources[int(source[0])][int(window[0])]
        got = train[i]
        assert set(got) == {"input_ids", "labels"}  # nothing extra reaches the model
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_every_prefix_of_the_blend_is_within_one_sample_of_its_share() -> None:
    """Largest sampling error first: after any n samples each source has within one sample of w_j * n."""
    rng = random.Random(1)
    for _ in range(30):
        weights = [rng.uniform(0.05, 3) for _ in range(rng.randint(2, 5))]
        parts, q = integer_weights(weights)
        source, rank = blend_period(parts, q)
        counts = np.zeros(len(parts))
        for n, s in enumerate(source, start=1):
            assert rank[n - 1] == counts[s]
            counts[s] += 1
            assert np.all(np.abs(counts - np.array(parts) / q * n) < 1), (weights, n)
    assert integer_weights([0.5, 0.3, 0.2]) == ([5, 3, 2], 10)  # decimal weights are exact
    with pytest.raises(ValueError):
        integer_weights([1.0, 0.0])


def test_a_short_source_wraps_around_and_a_long_one_is_strided_over_its_whole_length() -> None:
    blend = Blend.build([0.5, 0.5], [10, 990])  # 1,000 samples: 500 of each
    source, window = blend.locate(np.arange(blend.size))
    assert blend.upsampled() == [0]
    assert np.array_equal(np.bincount(window[source == 0]), np.full(10, 50))  # each of its 10 windows 50 times
    long = window[source == 1]
    assert len(set(long.tolist())) == 500 and long.min() == 0 and long.max() >= 980  # spread over all 990


def test_each_step_has_the_same_samples_on_1_2_and_4_ranks(dirs, tmp_path) -> None:
    """The global batch of every step, gathered from every rank's micro-batches as the trainer consumes them
    (iterate, then ``advance`` once a step), is the same tokens whatever the world size (micro_batch_size x
    grad_accum x world size = 8); and the telemetry's per-source counts equal those of the samples the ranks
    consumed, each sample's source found by its tokens among every source's own windows."""
    train = _bundle(dirs, tmp_path).train
    owner = {}  # every window's input_ids of every source -> the source
    for j, w in enumerate(train.sources):
        stream = w.split.window(0, len(w) * 32)
        owner.update({row.tobytes(): j for row in stream.reshape(-1, 32)})

    def steps(world_size: int, grad_accum: int, n_steps: int = 4) -> tuple[list[torch.Tensor], list[dict]]:
        samplers = [GlobalBatchSampler(len(train), micro_batch_size=2, grad_accum=grad_accum,
                                       world_size=world_size, rank=rank, seed=3) for rank in range(world_size)]
        for sampler in samplers:
            sampler.load_state_dict({"epoch": 1, "samples_in_epoch": 0})
        draws = [iter(sampler) for sampler in samplers]
        out, telemetry = [], []
        for _ in range(n_steps):
            ids = [i for draw in draws for _ in range(grad_accum) for i in next(draw)]
            out.append(torch.stack([train[i]["input_ids"] for i in ids]))
            telemetry.append(step_source_tokens(train, samplers[0].advance())["source_tokens"])
            for sampler in samplers[1:]:
                sampler.advance()
        return out, telemetry

    (one, counts), (two, _), (four, _) = steps(1, 4), steps(2, 2), steps(4, 1)
    for a, b, c in zip(one, two, four):
        assert torch.equal(a, b) and torch.equal(a, c)
    for batch, reported in zip(one, counts):
        consumed = np.bincount([owner[row.numpy().tobytes()] for row in batch], minlength=3) * 32  # label tokens
        assert list(reported) == list(WEIGHTS) and list(reported.values()) == consumed.tolist()
        assert sum(reported.values()) == 8 * 32


def test_a_single_directory_has_no_mixture_telemetry_and_masks_documents(dirs, tmp_path) -> None:
    opts = TokensConfig(path=str(dirs["wiki"]), seq_len=32, document_mask=True)
    bundle = build(opts, DataContext(cache_dir=tmp_path, is_main=True, barrier=lambda: None))
    sampler = GlobalBatchSampler(len(bundle.train), micro_batch_size=4, seed=0)
    assert step_source_tokens(bundle.train, sampler.advance()) == {}
    assert bundle.vocab_size == 512 and bundle.tokenizer_path.parent == dirs["wiki"]
    assert bundle.identity.data_fingerprint and bundle.pad_id == 0  # the trained BPE's <pad>, from meta.json
    item = bundle.train[0]
    assert set(item) == {"input_ids", "labels", "position_ids"} and item["position_ids"][0] == 0
