"""``scratch-ddp``: data parallelism and ZeRO-1 written from scratch (plugins/strategies/scratch_ddp/).

One 2-process gloo group (``tests/scratch_ddp_worker.py``, about 10 s) runs every distributed check once and
writes the results as JSON; the tests below read them. The rest runs in this process.

Measured with 2 ranks, fp32, 10 optimizer steps of grad_accum 2, gradient clipping active in most steps: every
variant (naive, flat, overlap, bucketed, each with and without shard_optimizer) ends with parameters *bitwise*
equal to torch DDP's (max abs diff 0.0), because

- an all-reduce of 2 operands is a + b on one rank and b + a on the other, and IEEE addition is commutative;
- dividing by the world size 2 is exact (a power of two), so averaging after the sum (here) and DDP's scaling
  before it give the same bits;
- gradient accumulation happens locally in ``.grad`` in the same order as under ``no_sync``;
- flattening into a bucket copies values, it does not change them;
- ZeRO-1 steps each parameter with the same per-element AdamW arithmetic, and its global gradient norm is
  computed from the same per-parameter norms as ``clip_grad_norm_`` (an all-reduce of a vector in which each
  rank fills only its own slots, zeros elsewhere: adding zeros is exact). A sum of squared norms all-reduced
  instead differs by 1 ulp, which Adam amplified to 1.4e-3 in the parameters after 10 steps (measured).

With more than 2 ranks the summation order of a ring all-reduce differs from DDP's, so only closeness is promised;
the tests assert the contract (max abs diff <= 1e-6), not the bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_handle.config.loader import load_preset
from torch_handle.errors import PresetError

from tests.helpers import worker_results

REPO = Path(__file__).resolve().parents[1]
VARIANTS = [f"{sync}{suffix}" for suffix in ("", "+zero1") for sync in ("naive", "flat", "overlap", "bucketed")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Per rank, what tests/scratch_ddp_worker.py measured in its 2-process group."""
    return worker_results("tests.scratch_ddp_worker", tmp_path_factory.mktemp("scratch") / "results.json")


@pytest.mark.dist
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_matches_torch_ddp(results, variant):
    """Same model, data and optimizer as torch DDP: the parameters after 10 steps agree within 1e-6 (measured:
    bitwise, see the module docstring), on both ranks, and the two replicas are identical."""
    for rank, found in enumerate(results):
        v = found["equivalence"][variant]
        assert v["max_abs_diff"] <= 1e-6, f"rank {rank} {variant}: {v}"
        assert v["replica_gap"] == 0.0, f"rank {rank} {variant}: replicas differ by {v['replica_gap']}"
        assert v["moved"] > 1e-2, "the parameters barely moved: the comparison would prove nothing"
        assert max(v["grad_norms"]) > 0.5, "clipping (at 0.5) was never active"
    if variant.startswith("bucketed"):
        assert results[0]["equivalence"][variant]["buckets"] > 1, "bucket_mb=0.01 should give several buckets"


@pytest.mark.dist
def test_sharded_optimizer_holds_half_of_the_optimizer_state(results):
    """ZeRO-1 on 2 ranks: each rank's optimizer_bytes is half of the unsharded figure (within 5%), and the shards
    add up to exactly the unsharded state (every parameter's Adam state lives on one rank)."""
    unsharded = [r["memory"]["unsharded"] for r in results]
    sharded = [r["memory"]["sharded"] for r in results]
    assert unsharded[0] == unsharded[1] > 0
    for rank, b in enumerate(sharded):
        assert abs(b / unsharded[rank] - 0.5) <= 0.025, f"rank {rank}: {b} of {unsharded[rank]}"
    assert sum(sharded) == unsharded[0]


@pytest.mark.dist
@pytest.mark.parametrize("sync", ["naive", "flat", "overlap", "bucketed"])
def test_gradients_are_communicated_only_on_the_last_micro_batch(results, sync):
    """grad_accum 4: no all-reduce (counted by wrapping torch.distributed.all_reduce) before the 4th micro-batch;
    then one per parameter (naive, overlap), one in all (flat) or one per bucket (bucketed), and step_stats
    reports exactly those calls and the bytes of every gradient once."""
    for found in results:
        m = found["micro_batches"][sync]
        expected = {"naive": m["params"], "flat": 1, "overlap": m["params"], "bucketed": m["buckets"]}[sync]
        assert m["calls_after_each_micro_batch"] == [0, 0, 0, expected]
        assert m["step_stats"]["allreduce_calls"] == expected
        assert m["step_stats"]["allreduce_bytes"] == m["grad_bytes"]
        assert m["step_stats"]["comm_s"] >= 0


@pytest.mark.dist
@pytest.mark.parametrize("sync", ["overlap", "bucketed"])
def test_close_removes_the_gradient_hooks(results, sync):
    """Before close(), a plain backward launches the hooks' all-reduces; after it, none, and no hook is left."""
    for found in results:
        h = found["hooks"][sync]
        assert h["hooks_before_close"] > 0 and h["calls_before_close"] > 0
        assert h["calls_after_close"] == 0 and h["hooks_left_on_params"] == 0
        assert found["resume"]["hooks_after_close"] == [0, 0, 0]  # the Trainer closes its strategy


@pytest.mark.dist
def test_sharded_run_resumes_exactly_from_per_rank_shards(results):
    """ZeRO-1 through the Trainer on 2 ranks: stopped after step 1 (stop file), resumed from a checkpoint holding one
    optimizer shard per rank, the losses equal an uninterrupted run's within 1e-5."""
    r = results[0]["resume"]
    assert (r["straight_status"], r["stopped_status"], r["resumed_status"]) == ("finished", "stopped", "finished")
    assert {"model.pt", "optim-rank0.pt", "optim-rank1.pt"} <= set(r["checkpoint_files"])
    assert "optim.pt" not in r["checkpoint_files"]
    straight, resumed = r["straight"], r["resumed"]
    assert sorted(straight) == sorted(resumed) == ["1", "2", "3", "4"]
    for step, loss in straight.items():
        assert abs(resumed[step] - loss) <= 1e-5 * abs(loss), (step, resumed[step], loss)
    assert straight["4"] < straight["1"]
    event = r["step_event"]  # every step event carries the communication figures
    assert event["allreduce_calls"] >= 1 and event["allreduce_bytes"] > 0 and event["comm_s"] >= 0
    optimizer_bytes = [m["optimizer_bytes"] for m in event["memory"]]
    assert len(optimizer_bytes) == 2 and all(b > 0 for b in optimizer_bytes)


# -- in this process -------------------------------------------------------------------------------------------


def _preset(tmp_path: Path, strategy: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(f'[strategy]\nname = "scratch-ddp"\n{strategy}\n[launch]\nnproc_per_node = 2\n', encoding="utf-8")
    return path


def test_options_are_typed_and_validated(tmp_path):
    p = load_preset(_preset(tmp_path, 'sync = "overlap"\nbucket_mb = 2.5\nshard_optimizer = true'))
    o = p.strategy.options
    assert (o.sync, o.bucket_mb, o.shard_optimizer) == ("overlap", 2.5, True)
    assert load_preset(_preset(tmp_path, "")).strategy.options.sync == "bucketed"
    with pytest.raises(PresetError, match="strategy.sync"):
        load_preset(_preset(tmp_path, 'sync = "ring"'))
    with pytest.raises(PresetError, match="strategy.bucket_mb"):
        load_preset(_preset(tmp_path, "bucket_mb = 0"))


def test_buckets_fill_in_reverse_registration_order():
    import torch

    from handle_plugins.strategies.scratch_ddp.bucketed import MB, make_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 10, 200_000, 300_000, 5)]  # fp32: 4 bytes each
    buckets = make_buckets(params, 1 * MB)  # 262,144 elements per bucket
    index = {id(p): i for i, p in enumerate(params)}
    order = [[index[id(p)] for p in b.params] for b in buckets]
    assert order == [[4, 3], [2, 1, 0]]  # a bucket closes once it reaches the cap (so may exceed it, as in DDP)
    assert [len(b.params) for b in make_buckets(params, 1e12)] == [5]


def test_shipped_presets_select_scratch_ddp():
    ddp = load_preset(REPO / "presets" / "scratch-ddp.toml")
    zero1 = load_preset(REPO / "presets" / "scratch-zero1.toml")
    assert ddp.strategy.name == zero1.strategy.name == "scratch-ddp"
    assert ddp.strategy.options.sync == zero1.strategy.options.sync == "bucketed"
    assert (ddp.strategy.options.shard_optimizer, zero1.strategy.options.shard_optimizer) == (False, True)
    assert ddp.world_size == zero1.world_size == 2


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_every_variant_steps_both_model_kinds_in_a_one_rank_group(tmp_path, kind):
    """World size 1 (a gloo group, as a torchrun worker of one process has): every sync mode, sharded or not,
    takes a step on both model kinds, reports its all-reduces, and close() leaves no hook behind."""
    import torch
    import torch.distributed as dist

    from handle_plugins.strategies import ScratchDDPConfig, build_scratch_ddp
    from torch_handle.model.args import TransformerArgs
    from torch_handle.model.transformer import build_transformer
    from torch_handle.config.schema import TrainingConfig
    from torch_handle.train.strategy import DistContext

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
        ids = torch.randint(0, 23, (2, 6))
        for shard in (False, True):
            for sync in ("naive", "flat", "overlap", "bucketed"):
                torch.manual_seed(0)
                model = build_transformer(TransformerArgs(23, d_model=16, n_heads=4, n_layers=1, d_ff=32, norm_first=True), kind=kind)
                strategy = build_scratch_ddp(ScratchDDPConfig(sync=sync, shard_optimizer=shard),
                                             TrainingConfig(steps=2, grad_accum=1, precision="fp32"), ctx, model)
                with strategy.accumulating(sync=True):
                    logits = strategy.model(ids) if kind == "decoder" else strategy.model(ids, ids)
                strategy.backward(logits.float().logsumexp(-1).mean())
                assert strategy.step() > 0
                stats = strategy.step_stats()
                n_params = len(list(model.parameters()))
                assert stats["allreduce_calls"] == {"naive": n_params, "flat": 1, "overlap": n_params,
                                                    "bucketed": 1}[sync], (sync, stats)
                assert stats["allreduce_bytes"] == sum(p.numel() * 4 for p in model.parameters())
                assert strategy.describe()["shard_optimizer"] is shard and strategy.optimizer_bytes() > 0
                strategy.close()
                assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    finally:
        dist.destroy_process_group()
