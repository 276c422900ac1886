"""``handle export``: a run's model in another format (``torch_handle.infer.hf_export``).

Click and the standard library at import; torch is imported inside the command, so ``handle --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("run_dir", metavar="RUN", type=click.Path(path_type=Path))
@click.argument("out", metavar="OUT", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="hf: a Hugging Face model directory (config.json, model.safetensors, tokenizer files).")
@click.option("--checkpoint", type=int, metavar="STEP",
              help="Weights of checkpoints/step-STEP (single, ddp, scratch-ddp, fsdp, pipeline runs; not "
                   "deepspeed) instead of the final model.safetensors.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Dtype of the exported weights.")
@click.option("--force", is_flag=True, help="Replace OUT when it is a Hugging Face model directory already "
                                            "(a non-empty OUT is refused otherwise; nothing else is deleted).")
@click.option("--merge", is_flag=True, help="A LoRA run: fold its adapters into the base and write the merged "
                                            "model (without it a LoRA run exports its adapters in peft's format).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: directory, architecture, params, ...")
def export(run_dir: Path, out: Path, fmt: str, checkpoint: int | None, dtype: str, force: bool, merge: bool,
           as_json: bool) -> None:
    """Write RUN's decoder to OUT as a Hugging Face model: LlamaForCausalLM, or Qwen3ForCausalLM with qk_norm.

    The run must be a Llama-shaped decoder (norm = "rmsnorm", position = "rope", mlp = "swiglu",
    norm_first = true, scale_embeddings = false; see presets/llama.toml); any other is refused with the first
    option that differs and the value it needs. OUT then loads with
    transformers.AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT), and a new
    run starts from it with [model] init_from = "OUT" (docs/hf.md).

    A LoRA run ([finetune] method = "lora") exports its adapters as peft's save_pretrained does
    (adapter_config.json, adapter_model.safetensors: peft.PeftModel.from_pretrained(base, OUT) loads them onto
    the transformers model of its init_from, whose path OUT stores relative to itself) and its tokenizer beside,
    or with --merge the model with the adapters folded in (docs/lora.md).

    \b
    Examples:
      handle export runs/llama-20260101-120000 --format hf exported/llama
      handle export runs/llama-20260101-120000 exported/llama --checkpoint 200 --dtype bfloat16 --force --json
      handle export runs/lora-20260101-130000 exported/lora-adapter
      handle export runs/lora-20260101-130000 exported/lora-merged --merge

    Exit code 2 with one line on stderr, and nothing written, for a run that cannot be exported or a non-empty OUT.
    """
    from torch_handle.infer.adapter_export import export_run

    result = export_run(run_dir, out, checkpoint=checkpoint, dtype=dtype, force=force, merge=merge)
    if as_json:
        click.echo(json.dumps(result))
        return
    if result["format"] == "peft":
        click.echo(f"exported {run_dir}'s LoRA adapters to {out}: r {result['r']}, lora_alpha {result['lora_alpha']:g} "
                   f"on {', '.join(result['target_modules'])}, {result['params']:,} parameters")
        click.echo(f"load with: peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                   f"{result['base_dir']!r}), {str(out)!r}); its tokenizer: AutoTokenizer.from_pretrained("
                   f"{str(out)!r})")
        return
    step = f" (step {result['step']})" if result["step"] is not None else ""
    click.echo(f"exported {run_dir}{step} to {out}: {result['architecture']}, {result['params']:,} parameters, "
               f"{result['dtype']} ({', '.join(result['files'])})")
    click.echo(f"load with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
