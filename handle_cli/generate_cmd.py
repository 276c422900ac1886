"""``handle generate``, ``handle translate``, ``handle eval``: use a trained run (``torch_handle.infer.generate``).

Click and the standard library at import; torch is imported inside the commands, so ``handle --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from handle_cli.common import fail

_RUN = click.argument("run_dir", metavar="RUN", type=click.Path(path_type=Path))
_CHECKPOINT = click.option("--checkpoint", type=int, metavar="STEP",
                           help="Weights of checkpoints/step-STEP (single, ddp, scratch-ddp, fsdp; not "
                                "deepspeed) instead of model.safetensors.")


def _load(run_dir: Path, checkpoint: int | None, kind: str, command: str):
    from torch_handle.infer.generate import load_run

    loaded = load_run(run_dir, checkpoint)
    loaded.model.requires_grad_(False)  # inference only: no graph is built (not a global switch: tests run in-process)
    if kind and loaded.kind != kind:
        other = "translate" if loaded.kind == "encoder-decoder" else "generate"
        fail(f"{run_dir}: handle {command} needs a {kind} run, this is an {loaded.kind} run (use handle {other})")
    return loaded


@click.command()
@_RUN
@click.argument("prompt", required=False, default="")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.8, show_default=True,
              help="Softmax temperature; 0 = greedy (always the most likely token).")
@click.option("--top-k", type=click.IntRange(min=0), default=50, show_default=True,
              help="Sample among the K most likely tokens (0 = all).")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (default: random).")
@click.option("--chat", "message", metavar="MESSAGE",
              help="A run fine-tuned on conversations: answer MESSAGE as the assistant (its chat template), stopping "
                   "at the end of turn.")
@click.option("--system", metavar="TEXT", help="--chat: a system turn first.")
@_CHECKPOINT
def generate(run_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int | None,
             message: str | None, system: str | None, checkpoint: int | None) -> None:
    """Continue PROMPT with a decoder (language-model) run, printing tokens as they are produced.

    Exactly --max-new-tokens tokens are generated; <eos> (a paragraph boundary in training) prints as a blank
    line. Decoding is cached (keys/values of earlier positions are kept), one forward pass per token. With
    --chat, the run's chat template renders the message and generation stops at the end of the turn.

    \b
    Examples:
      handle generate runs/llama-20260101-120000 "The module"
      handle generate runs/sft-20260101-120000 --chat "Name three fruits." --temperature 0
    """
    import torch

    from torch_handle.infer.generate import StreamDecoder, sample

    loaded = _load(run_dir, checkpoint, "decoder", "generate")
    generator = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**63))
    if message is not None:
        _answer(loaded, [*_system(system), {"role": "user", "content": message}], max_new_tokens, temperature,
                top_k, generator)
        return
    prompt_ids = loaded.tokenizer.encode(prompt).ids if prompt else []
    stream = StreamDecoder(loaded.tokenizer)
    out = sys.stdout
    out.write(prompt)
    out.flush()
    for token in sample(loaded.model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                        generator=generator):
        piece = stream.push(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(stream.flush() + "\n")
    out.flush()


def _system(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def _answer(loaded, messages: list[dict[str, str]], max_new_tokens: int, temperature: float, top_k: int,
            generator) -> str:
    """Stream the assistant's reply to ``messages`` to stdout; returns its text."""
    from torch_handle.infer.chat import reply, run_template
    from torch_handle.infer.generate import StreamDecoder

    template = run_template(loaded.run_dir)
    stream, text = StreamDecoder(loaded.tokenizer), []
    for token in reply(loaded.model, loaded.tokenizer, template, messages, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, generator=generator):
        if piece := stream.push(token):
            text.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    text.append(stream.flush())
    sys.stdout.write(text[-1] + "\n")
    sys.stdout.flush()
    return "".join(text)


@click.command()
@_RUN
@click.option("--system", metavar="TEXT", help="A system turn first.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Longest reply (it ends earlier at the end of turn).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="Softmax temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="Sample among the K most "
                                                                                          "likely tokens (0 = all).")
@click.option("--seed", type=int, default=None, help="Seed of the sampler (default: random).")
@_CHECKPOINT
def chat(run_dir: Path, system: str | None, max_new_tokens: int, temperature: float, top_k: int, seed: int | None,
         checkpoint: int | None) -> None:
    """Talk to RUN, a run fine-tuned on conversations: each line you type is a user turn, the reply streams as it
    is generated and the conversation keeps its history (rendered by the run's chat template, as in training). An
    empty line or end of input (Ctrl-D) ends it.

    \b
    Examples:
      handle chat runs/sft-20260101-120000
      handle chat runs/sft-20260101-120000 --system "Answer in German." --temperature 0.7
    """
    import torch

    from torch_handle.infer.chat import run_template

    loaded = _load(run_dir, checkpoint, "decoder", "chat")
    run_template(loaded.run_dir)  # a run with no template: one line, before the first prompt
    generator = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**63))
    messages = _system(system)
    while True:
        try:
            line = click.prompt("you", default="", show_default=False, prompt_suffix="> ")
        except click.exceptions.Abort:  # end of input
            return
        if not line.strip():
            return
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        messages.append({"role": "assistant", "content": _answer(loaded, messages, max_new_tokens, temperature,
                                                                 top_k, generator)})


@click.command()
@_RUN
@click.argument("text", required=False)
@click.option("--input", "input_file", type=click.Path(path_type=Path, dir_okay=False),
              help="Translate every line of FILE (one sentence per line; - reads stdin).")
@click.option("--beam", type=click.IntRange(min=1), default=4, show_default=True, help="Beam size; 1 = greedy.")
@click.option("--alpha", type=click.FloatRange(min=0.0), default=0.6, show_default=True,
              help="GNMT length-penalty exponent (Wu et al. 2016); 0 ranks beams by raw log-probability.")
@click.option("--max-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Most target tokens per sentence (also capped by the model's positional table).")
@_CHECKPOINT
def translate(run_dir: Path, text: str | None, input_file: Path | None, beam: int, alpha: float, max_len: int,
              checkpoint: int | None) -> None:
    """Translate TEXT (or each line of --input FILE) with an encoder-decoder run; one line out per line in."""
    from torch_handle.infer.generate import translate as translate_texts

    if (text is None) == (input_file is None):
        fail("give either TEXT or --input FILE (one sentence per line)")
    if input_file is not None:
        if str(input_file) == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                lines = input_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                fail(f"{input_file}: cannot read ({getattr(e, 'strerror', None) or e})")
    else:
        lines = [text]
    loaded = _load(run_dir, checkpoint, "encoder-decoder", "translate")
    batch = 1 if len(lines) == 1 else 32
    for start in range(0, len(lines), batch):  # print as each batch is done
        for line in translate_texts(loaded.model, loaded.tokenizer, lines[start:start + batch], beam=beam,
                                    alpha=alpha, max_len=max_len, batch_size=batch):
            click.echo(line)


@click.command(name="eval")
@_RUN
@click.option("--split", type=click.Choice(["valid", "test", "train"]), default="valid", show_default=True,
              help="valid: the validation split as the dataset plugin builds it (with --data: the directory's); "
                   "test: the parallel test files (translation runs); train: the --data directory's train split.")
@click.option("--data", "data_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Score a prepared token directory (handle data prepare; the run's tokenizer) instead of the "
                   "run's own data (language-model runs).")
@click.option("--beam", type=click.IntRange(min=1), default=4, show_default=True,
              help="Beam size for BLEU/chrF (translation runs); 1 = greedy.")
@click.option("--alpha", type=click.FloatRange(min=0.0), default=0.6, show_default=True,
              help="GNMT length-penalty exponent.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_CHECKPOINT
@click.option("--tasks", metavar="T1,T2", help="lm-evaluation-harness tasks instead of the loss (the eval extra; "
              "offline: local tasks with --include-path), e.g. --tasks hellaswag,arc_easy; results go to RUN/evals/.")
@click.option("--num-fewshot", type=int, metavar="K", help="--tasks: K examples before each question (default: "
                                                           "the task's own).")
@click.option("--limit", type=int, metavar="N", help="--tasks: the first N documents of each task.")
@click.option("--batch-size", type=int, metavar="B", help="--tasks: requests per forward (default 16).")
@click.option("--include-path", "include_paths", multiple=True, type=click.Path(path_type=Path), metavar="DIR",
              help="--tasks: a directory of task YAMLs (dataset_path: json; relative data_files are read beside "
                   "the YAML); repeatable.")
@click.option("--log-samples", is_flag=True, help="--tasks: also write every request and response "
                                                  "(RUN/evals/...-samples.jsonl).")
def eval_cmd(run_dir: Path, split: str, data_dir: Path | None, beam: int, alpha: float, as_json: bool,
             checkpoint: int | None, tasks: str | None, num_fewshot: int | None, limit: int | None,
             batch_size: int | None, include_paths: tuple[Path, ...], log_samples: bool) -> None:
    """Loss and perplexity of a run on a split; for translation runs also BLEU and chrF (sacrebleu, detokenized);
    with --tasks, downstream tasks of EleutherAI's lm-evaluation-harness (docs/evaluation.md).

    Language-model runs have the validation split, or with --data DIR either split of any directory prepared with
    the run's tokenizer. Translation runs: the loss on the split's pairs, and BLEU/chrF of the beam-search
    translations of its source side against its target side.

    \b
    Examples:
      handle eval runs/llama-20250101-120000
      handle eval runs/llama-20250101-120000 --data data/wiki-tokens --json
      handle eval runs/llama-20250101-120000 --data data/wiki-tokens --split train
      handle eval runs/llama-20250101-120000 --tasks handle_wikitext_cloze,handle_seed_answers \\
          --include-path tests/fixtures/eval_tasks --limit 50 --checkpoint 200 --json
    """
    from handle_cli.eval_tasks import check_task_options, run_tasks

    check_task_options(tasks, {"num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size,
                               "include_paths": include_paths, "log_samples": log_samples})
    if tasks is not None:
        run_tasks(run_dir, checkpoint, tasks, num_fewshot, limit, batch_size, include_paths, log_samples, as_json)
        return
    from torch_handle.infer import generate as g
    from torch_handle.data.corpus import read_pairs
    from torch_handle.data.datasets import pad_collate

    if data_dir is not None and split == "test":
        fail(f"--data {data_dir}: a prepared directory has the splits valid and train (use --split valid or train)")
    if data_dir is None and split == "train":
        fail("--split train scores a prepared directory's train split: give --data DIR")
    loaded = _load(run_dir, checkpoint, "decoder" if data_dir is not None else "", "eval")
    if data_dir is None and loaded.preset.finetune.objective == "dpo":  # its validation split holds pairs
        fail(f"{run_dir}: a preference (dpo) run's validation loss and rewards are its eval events (handle tui, "
             f"events.jsonl); give --data DIR (text prepared with its tokenizer) or --tasks")
    started = time.perf_counter()
    opts = loaded.preset.data.options
    batch_size = loaded.preset.training.micro_batch_size
    result = {"run": str(run_dir), "weights": str(loaded.weights), "kind": loaded.kind, "split": split}
    if data_dir is not None:
        from torch_handle.infer.eval_data import prepared_split

        dataset = prepared_split(run_dir, loaded.preset, loaded.model.args.max_len, data_dir, split)
        result["data"] = str(data_dir)
        loss, tokens = g.evaluate_loss(loaded.model, dataset, None, batch_size)
    elif loaded.kind == "decoder":
        if split != "valid":
            fail(f"{run_dir}: a language-model run has only a validation split (use --split valid)")
        dataset, collate = g.validation_split(loaded)
        loss, tokens = g.evaluate_loss(loaded.model, dataset, collate, batch_size)
    else:
        src_path, tgt_path = g.parallel_files(opts, split)
        src, ref = read_pairs(src_path, tgt_path)
        dataset = g.translation_dataset(loaded.tokenizer, src, ref, opts.seq_len)
        loss, tokens = g.evaluate_loss(loaded.model, dataset, pad_collate, batch_size)
        hyps = g.translate(loaded.model, loaded.tokenizer, src, beam=beam, alpha=alpha, max_len=opts.seq_len)
        result.update(source=str(src_path), reference=str(tgt_path), sentences=len(src), beam=beam, alpha=alpha,
                      **g.bleu_chrf(hyps, ref))
    result.update(loss=round(loss, 4), perplexity=round(g.perplexity(loss), 3), tokens=tokens,
                  seconds=round(time.perf_counter() - started, 1))
    if as_json:
        click.echo(json.dumps(result))
        return
    line = f"{data_dir} ({split})" if data_dir is not None else split
    line = f"{line}: loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  ({tokens} tokens)"
    if "bleu" in result:
        line += (f"\nBLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  ({result['sentences']} sentences, "
                 f"beam {beam})\n{result['bleu_signature']}\n{result['chrf_signature']}")
    click.echo(line)
