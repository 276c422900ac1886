"""The ds_config handle generates from a preset, and ``[strategy.ds_config]`` merged over it (no DeepSpeed import:
this is the dictionary DeepSpeed is given, see https://www.deepspeed.ai/docs/config-json/)."""

from __future__ import annotations

from handle_plugins.strategies import DeepSpeedConfig
from handle_plugins.strategies.deepspeed import build_ds_config
from torch_handle.config.schema import TrainingConfig


def test_batch_sizes_clipping_and_zero_stage_come_from_the_preset() -> None:
    t = TrainingConfig(micro_batch_size=4, grad_accum=3, grad_clip=0.5, precision="fp32")
    cfg = build_ds_config(DeepSpeedConfig(zero_stage=2), t, world_size=2, cuda=False)
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_batch_size"] == 4 * 3 * 2  # DeepSpeed checks this product itself
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    assert "bf16" not in cfg and "fp16" not in cfg
    adam = cfg["optimizer"]["params"]
    assert cfg["optimizer"]["type"] == "AdamW" and adam["torch_adam"] is True and adam["betas"] == [0.9, 0.95]


def test_stage_0_has_no_bucket_settings_and_precision_picks_the_section() -> None:
    cfg = build_ds_config(DeepSpeedConfig(zero_stage=0), TrainingConfig(precision="bf16"), 1, cuda=False)
    assert cfg["zero_optimization"] == {"stage": 0}
    assert cfg["bf16"] == {"enabled": True}
    fp16 = build_ds_config(DeepSpeedConfig(initial_scale_power=12), TrainingConfig(precision="fp16"), 1, False)["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 12


def test_offload_uses_deepspeeds_cpu_adam_and_pins_memory_only_on_cuda() -> None:
    o = DeepSpeedConfig(zero_stage=3, offload_optimizer="cpu", offload_param="nvme", nvme_path="/scratch")
    cpu = build_ds_config(o, TrainingConfig(), 2, cuda=False)["zero_optimization"]
    assert cpu["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cpu["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/scratch"}
    assert build_ds_config(o, TrainingConfig(), 2, cuda=True)["zero_optimization"]["offload_optimizer"]["pin_memory"]
    assert "torch_adam" not in build_ds_config(o, TrainingConfig(), 2, cuda=False)["optimizer"]["params"]


def test_the_users_ds_config_is_merged_over_nested_tables() -> None:
    over = {"zero_optimization": {"reduce_bucket_size": 1000, "round_robin_gradients": True},
            "wall_clock_breakdown": True}
    o = DeepSpeedConfig(zero_stage=1, ds_config=over)
    cfg = build_ds_config(o, TrainingConfig(), 2, cuda=False)
    assert cfg["zero_optimization"] == {"stage": 1, "overlap_comm": False, "contiguous_gradients": True,
                                        "reduce_bucket_size": 1000, "round_robin_gradients": True}
    assert cfg["wall_clock_breakdown"] is True
    cfg["zero_optimization"]["stage"] = 3
    assert o.ds_config["zero_optimization"] == {"reduce_bucket_size": 1000, "round_robin_gradients": True}
