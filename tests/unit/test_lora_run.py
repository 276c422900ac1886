"""A LoRA run in this process (gloo, world size 1; the harness of test_trainer_step.py): a Llama-shaped run exported
with ``handle export --format hf`` is the frozen base of a ``[finetune] method = "lora"`` run, which saves its
adapters alone, holds optimizer state for them alone, leaves the base bitwise as it was, stops and resumes to the
uninterrupted losses, refuses a changed base in one line, and hands on its adapters: peft loads them onto the
``transformers`` model of the base with our logits, and the ``--merge`` export gives them too."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_trainer_step import _events, _preset, _train, fake_peak, process_group  # noqa: F401
from torch_handle.config.loader import dump_preset
from torch_handle.data.chat.template import CHATML, TEMPLATE_FILE
from torch_handle.errors import CheckpointError
from torch_handle.finetune.lora import BASE_HASH_BUFFER, adapter_modules
from torch_handle.rundir import STOP_FILE, create_run_dir

LLAMA = 'norm = "rmsnorm"\nposition = "rope"\nmlp = "swiglu"\nnorm_first = true\nscale_embeddings = false\n'
LORA = '[finetune]\nmethod = "lora"\nrank = 4\nalpha = 8.0\ntarget_modules = ["all"]\n'


def _lora_preset(tmp_path, steps: int):
    # _preset puts its model text under [model]: the [finetune] table follows it
    return _preset(tmp_path, steps=steps, model=LLAMA + f'init_from = "{tmp_path / "hf"}"\nfused_qkv = false\n' + LORA)


def _steps(run_dir):
    return [e for e in _events(run_dir) if e["kind"] == "step"]


def test_a_lora_run_trains_adapters_alone_resumes_and_hands_them_on(tmp_path, process_group):
    from torch_handle.infer.adapter_export import export_run
    from torch_handle.infer.hf_export import export_hf

    exporter = _preset(tmp_path, steps=1, model=LLAMA + "fused_qkv = false")
    source = create_run_dir(tmp_path / "runs", "base", dump_preset(exporter), {"status": "starting"})
    assert _train(exporter, source, process_group) == "finished"
    export_hf(source, tmp_path / "hf")
    base = load_file(str(tmp_path / "hf" / "model.safetensors"))

    preset = _lora_preset(tmp_path, steps=2)
    assert preset.finetune.method == "lora"
    straight = create_run_dir(tmp_path / "runs", "straight", dump_preset(preset), {"status": "starting"})
    assert _train(preset, straight, process_group) == "finished"
    steps = _steps(straight)
    saved = load_file(str(straight / "model.safetensors"))
    assert BASE_HASH_BUFFER in saved and all(".lora_A." in k or ".lora_B." in k for k in saved if k != BASE_HASH_BUFFER)
    trainable = [t for k, t in saved.items() if k != BASE_HASH_BUFFER]
    # AdamW's exp_avg and exp_avg_sq (fp32) and a 4-byte step per trainable tensor: nothing for the frozen base
    assert steps[0]["memory"][0]["optimizer_bytes"] == sum(8 * t.numel() + 4 for t in trainable)
    logs = [e["message"] for e in _events(straight) if e["kind"] == "log"]
    assert any(m.startswith("LoRA rank 4 on 7 linears: ") for m in logs), logs

    run_dir = create_run_dir(tmp_path / "runs", "stopped", dump_preset(preset), {"status": "starting"})
    (run_dir / STOP_FILE).touch()
    assert _train(preset, run_dir, process_group) == "stopped"
    (run_dir / STOP_FILE).unlink()
    ckpt = torch.load(run_dir / "checkpoints" / "step-1" / "model.pt", weights_only=True)
    assert not any(k.endswith("base.weight") or k.startswith("embed") for k in ckpt)  # adapters (+ hash) only
    assert _train(preset, run_dir, process_group) == "finished"
    assert [e["loss"] for e in _steps(run_dir)] == pytest.approx([e["loss"] for e in steps], rel=1e-6, abs=0)

    # handed on: adapters in peft's format onto transformers' base, and the merged model; the chat template an SFT
    # run keeps beside its weights (data.chat.template.copy_chat_files) goes with the adapters (issue 46)
    (straight / TEMPLATE_FILE).write_text(CHATML, encoding="utf-8")
    result = export_run(straight, tmp_path / "adapter")
    assert {TEMPLATE_FILE, "generation_config.json"} <= set(result["files"])
    assert (tmp_path / "adapter" / TEMPLATE_FILE).read_text() == CHATML
    # the base relative to the adapters (the two move together) and the run's tokenizer beside them (issue 38)
    assert result["format"] == "peft" and result["base"] == os.path.join("..", "hf")
    assert result["base_dir"] == str(tmp_path / "hf")
    stored = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (tmp_path / "adapter" / stored).resolve() == (tmp_path / "hf").resolve()
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(result["files"])
    assert (tmp_path / "adapter" / "tokenizer.json").read_bytes() == (straight / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "adapter" / "tokenizer_config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "tokenizer_config.json").read_text())
    export_run(straight, tmp_path / "merged", merge=True)
    assert load_file(str(tmp_path / "hf" / "model.safetensors")).keys() == base.keys()
    if os.environ.get("CI") or _has("peft"):
        _logits_agree(tmp_path, straight)

    _qlora_trains_on_an_nf4_base(tmp_path, process_group, base, steps)

    # a changed base: the resume refuses it in one line (its adapters were trained on the old one)
    base["model.norm.weight"] = base["model.norm.weight"] + 1e-3
    save_file(base, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="the frozen base changed since these adapters were trained") as e:
        _train(_lora_preset(tmp_path, steps=3), run_dir, process_group)
    assert "\n" not in str(e.value)
    from torch_handle.launch.run import check_inputs

    (tmp_path / "hf").rename(tmp_path / "moved")  # a LoRA resume needs its base: checked before anything starts
    with pytest.raises(CheckpointError, match=f"^model.init_from: {tmp_path / 'hf'}: no such directory"):
        check_inputs(preset, resume=True)


def _nf4_bytes(n: int) -> int:
    """Stored bytes of an n-element NF4 weight, double-quantised: codes, 8-bit constants, scales, the mean."""
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4


def _qlora_trains_on_an_nf4_base(tmp_path, process_group, base, lora_steps) -> None:
    """The same run with method = "qlora": every block linear of the base in NF4 (its bytes in the telemetry, to
    the byte), the adapters as LoRA's, no NF4 buffer in a checkpoint, a resume that rebuilds the same NF4 bytes
    (the uninterrupted losses), and the merged export our model's logits."""
    from torch_handle.infer.adapter_export import export_run

    preset = _preset(tmp_path, steps=2, model=LLAMA + f'init_from = "{tmp_path / "hf"}"\nfused_qkv = false\n'
                     + LORA.replace('"lora"', '"qlora"'))
    straight = create_run_dir(tmp_path / "runs", "qlora", dump_preset(preset), {"status": "starting"})
    assert _train(preset, straight, process_group) == "finished"
    steps = _steps(straight)
    assert any(e["message"].startswith("QLoRA rank 4 on 7 linears: ") for e in _events(straight) if e["kind"] == "log")
    linears = [t.numel() for k, t in base.items() if k.startswith("model.layers.") and k.endswith("proj.weight")]
    assert len(linears) == 7
    lora, qlora = lora_steps[0]["memory"][0], steps[0]["memory"][0]
    # the base's linears at 4.127 bits instead of fp32's 32; adapters, gradients and optimizer state as LoRA's
    assert qlora["frozen_param_bytes"] == lora["frozen_param_bytes"] - 4 * sum(linears) + sum(map(_nf4_bytes, linears))
    for key in ("trainable_param_bytes", "grad_bytes", "optimizer_bytes"):
        assert qlora[key] == lora[key] > 0, key
    assert qlora["param_bytes"] == qlora["trainable_param_bytes"] + qlora["frozen_param_bytes"]
    assert lora["param_bytes"] == lora["trainable_param_bytes"] + lora["frozen_param_bytes"]
    _estimate_is_the_telemetry(preset, qlora)
    # MFU counts what is computed: the NF4 weights (buffers, not parameters) cost their 4 FLOPs a token as LoRA's
    # frozen fp32 ones do, so the two count the same FLOPs per token
    per_token = [e["tflops"] / e["tokens_per_s"] for e in (lora_steps[0], steps[0])]
    assert per_token[1] == pytest.approx(per_token[0], rel=1e-6)
    losses = [e["loss"] for e in steps]
    assert losses[0] == pytest.approx(lora_steps[0]["loss"], rel=1e-2) and losses[0] != lora_steps[0]["loss"]

    run_dir = create_run_dir(tmp_path / "runs", "qlora-stopped", dump_preset(preset), {"status": "starting"})
    (run_dir / STOP_FILE).touch()
    assert _train(preset, run_dir, process_group) == "stopped"
    (run_dir / STOP_FILE).unlink()
    ckpt = torch.load(run_dir / "checkpoints" / "step-1" / "model.pt", weights_only=True)
    assert not any("weight_" in k or k.endswith("base.weight") for k in ckpt)  # no NF4 buffer, no base
    assert _train(preset, run_dir, process_group) == "finished"  # the NF4 base rebuilt from the checked base
    assert [e["loss"] for e in _steps(run_dir)] == pytest.approx(losses, rel=1e-6, abs=0)

    export_run(straight, tmp_path / "qlora-adapter")
    export_run(straight, tmp_path / "qlora-merged", merge=True)  # the dequantised base, adapters folded in
    assert load_file(str(tmp_path / "qlora-merged" / "model.safetensors")).keys() == base.keys()
    if os.environ.get("CI") or _has("peft"):
        _qlora_logits_agree(tmp_path, straight)


def _estimate_is_the_telemetry(preset, memory) -> None:
    """``handle estimate``'s figures of the QLoRA preset equal the run's to the byte: the NF4 buffers sized on
    the meta device as quantisation sizes them, the rest of the base and the adapters as the strategy keeps them."""
    from torch_handle.plan.estimate import estimate_preset
    from torch_handle.registry import get_registry

    (row,) = estimate_preset(preset, get_registry(), [1])
    keys = ("param_bytes", "trainable_param_bytes", "frozen_param_bytes", "grad_bytes", "optimizer_bytes")
    assert {k: row.as_dict()[k] for k in keys} == {k: memory[k] for k in keys}


def _qlora_logits_agree(tmp_path, run_dir) -> None:
    """The merged export gives our logits (1e-5); peft's adapters on the unquantised fp32 base give them within
    the NF4 error: bounded by twice the base's own logit error from quantisation (measured: docs/qlora.md)."""
    import peft
    import transformers

    from torch_handle.infer.generate import load_run

    ours = load_run(run_dir).model
    load = transformers.AutoModelForCausalLM.from_pretrained
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)
        torch.testing.assert_close(load(str(tmp_path / "qlora-merged"), dtype=torch.float32).eval()(ids).logits,
                                   expected, atol=1e-5, rtol=0)
        base = load(str(tmp_path / "hf"), dtype=torch.float32).eval()
        for module in adapter_modules(ours).values():  # zero adapters: our NF4 base alone
            for b in module.lora_B.values():
                b.weight.zero_()
        nf4_error = (ours(ids) - base(ids).logits).abs().max().item()
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "qlora-adapter")).eval()
        error = (adapted(ids).logits - expected).abs().max().item()
    assert 0 < nf4_error and error <= 2 * nf4_error, (error, nf4_error)
    print(f"QLoRA logits: peft on the fp32 base vs ours {error:.3g}, NF4 base vs fp32 base {nf4_error:.3g}")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _logits_agree(tmp_path, run_dir) -> None:
    import peft
    import transformers

    from torch_handle.infer.generate import load_run

    ours = load_run(run_dir).model
    adapter = tmp_path / "adapter"
    stored = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = transformers.AutoModelForCausalLM.from_pretrained(adapter / stored, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)  # beside the adapters
    assert tokenizer("def f(x):")["input_ids"] == load_run(run_dir).tokenizer.encode("def f(x):").ids
    # the template beside them: transformers renders the prompt handle generate --chat sends, and stops where it stops
    from torch_handle.infer.chat import end_of_turn_ids, prompt_ids, run_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    template, run_tokenizer = run_template(run_dir), load_run(run_dir).tokenizer
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"] == prompt_ids(run_tokenizer, template, messages)
    generation = transformers.GenerationConfig.from_pretrained(adapter)
    assert sorted(end_of_turn_ids(run_tokenizer, template)) == generation.eos_token_id != []
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with torch.no_grad():
        expected = ours(ids)
        assert (expected - base_logits).abs().max() > 1e-4  # the adapters changed the model
        torch.testing.assert_close(adapted(ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-5, rtol=0)
