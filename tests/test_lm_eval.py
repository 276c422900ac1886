"""``handle eval RUN --tasks`` against the harness's own ``hf`` model (issue 50, done-when 1 and 2's LoRA case): a tiny
Llama-shaped run trained in this process (gloo, world size 1, fp32, 2 steps, a checkpoint at 2) and exported with
``handle export --format hf``; on the local multiple-choice and generation tasks of tests/fixtures/eval_tasks,
``handle eval --checkpoint 2`` and ``lm_eval.simple_evaluate(model="hf", pretrained=EXPORT)`` give the same acc,
acc_norm and exact_match, every log-likelihood within 1e-5, the same greedy flags and the same generated text; a
LoRA run on that export scored with its adapters unmerged equals its ``--merge`` export under ``hf``, an MoE run its
Mixtral export, a 2017 decoder (no HF class) its own forward and ``handle generate``; and bad input is one line,
exit 2, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from handle_cli.main import cli
from tests.helpers import parallel_corpus
from tests.unit.test_trainer_step import _train
from torch_handle.config.loader import dump_preset, load_preset
from torch_handle.data.corpus import pydoc_corpus
from torch_handle.data.datasets import EOS_ID
from torch_handle.rundir import create_run_dir
from torch_handle.train.strategy import DistContext

lm_eval = pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

TASKS_DIR = Path(__file__).parent / "fixtures" / "eval_tasks"
TASKS = ["handle_wikitext_cloze", "handle_seed_answers", "handle_wikitext_ppl"]
LIMIT = 4
LLAMA = ('norm = "rmsnorm"\nposition = "rope"\nmlp = "swiglu"\nnorm_first = true\nscale_embeddings = false\n'
         'n_kv_heads = 1\ntie_embeddings = false\nfused_qkv = false\n')


def _preset(root: Path, name: str, model: str, extra: str = "", data: str = ""):
    """One process (single strategy, the defaults), on ``data`` (default: 60,000 characters of the pydoc text), 128
    positions (a generation task's prompt + 16 tokens), a checkpoint at step 2, fp32."""
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n\n".join(pydoc_corpus())[:60_000], encoding="utf-8")
    data = data or f'name = "text"\npath = "{corpus}"'
    path = root / f"{name}.toml"
    path.write_text(f"""
[run]
output_dir = "{root / 'runs'}"
[model]
n_layers = 1
d_model = 32
d_ff = 64
n_heads = 2
dropout = 0.0
{model}
[data]
{data}
seq_len = 128
vocab_size = 300
[training]
steps = 2
micro_batch_size = 4
precision = "fp32"
eval_every = 0
checkpoint_every = 2
log_every = 1
warmup_steps = 0
lr = 0.02
{extra}""", encoding="utf-8")
    return load_preset(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``llama`` (a run) and its HF export ``hf``; ``lora`` (rank 4 on every linear of that export, 2 steps) and
    its merged export ``lora_merged``; ``moe`` (4 experts, top-2, every layer: Mixtral-shaped) and its export
    ``moe_hf``; ``classic``, the default (2017) decoder; ``translate``, an encoder-decoder run (2 steps each)."""
    from torch_handle.infer.adapter_export import export_run

    root = tmp_path_factory.mktemp("lm_eval")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    found: dict[str, Path] = {}
    try:
        preset = _preset(root, "llama", LLAMA)
        found["llama"] = create_run_dir(root / "runs", "llama", dump_preset(preset), {"status": "starting"})
        assert _train(preset, found["llama"], ctx) == "finished"
        export_run(found["llama"], root / "hf")
        found["hf"] = root / "hf"
        lora = _preset(root, "lora", LLAMA + f'init_from = "{root / "hf"}"',
                       '[finetune]\nmethod = "lora"\nrank = 4\nalpha = 8.0\ntarget_modules = ["all"]\n')
        found["lora"] = create_run_dir(root / "runs", "lora", dump_preset(lora), {"status": "starting"})
        assert _train(lora, found["lora"], ctx) == "finished"
        export_run(found["lora"], root / "lora_merged", merge=True)
        found["lora_merged"] = root / "lora_merged"
        moe = _preset(root, "moe", LLAMA + "bias = false\nn_experts = 4\ntop_k = 2\nd_ff_expert = 48\n")  # Mixtral
        found["moe"] = create_run_dir(root / "runs", "moe", dump_preset(moe), {"status": "starting"})
        assert _train(moe, found["moe"], ctx) == "finished"
        export_run(found["moe"], root / "moe_hf")
        found["moe_hf"] = root / "moe_hf"
        classic = _preset(root, "classic", "")  # the 2017 decoder: post-LN, sinusoidal, ReLU; no HF class
        found["classic"] = create_run_dir(root / "runs", "classic", dump_preset(classic), {"status": "starting"})
        assert _train(classic, found["classic"], ctx) == "finished"
        pairs = parallel_corpus(root / "pairs")
        translate = _preset(root, "translate", 'kind = "encoder-decoder"',
                            data=f'name = "parallel"\npath = "{pairs}"\nsrc_lang = "en"\ntgt_lang = "de"')
        found["translate"] = create_run_dir(root / "runs", "translate", dump_preset(translate), {"status": "starting"})
        assert _train(translate, found["translate"], ctx) == "finished"
    finally:
        dist.destroy_process_group()
    return found


def _handle_eval(run_dir: Path, *extra: str) -> tuple[dict, list[dict]]:
    result = CliRunner().invoke(cli, ["eval", str(run_dir), "--tasks", ",".join(TASKS), "--include-path",
                                      str(TASKS_DIR), "--limit", str(LIMIT), "--batch-size", "4", "--log-samples",
                                      "--json", *extra])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    written = json.loads(Path(out["file"]).read_text())
    samples = Path(out["file"]).with_name(written["handle"]["samples_file"]).read_text().splitlines()
    return written, [json.loads(s) for s in samples]


def _hf_eval(export: Path) -> dict:
    from torch_handle.infer import downstream

    specs, manager = downstream.resolve_tasks(TASKS, [TASKS_DIR])
    with downstream.offline():
        return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", device="cpu",
                                       batch_size=4, tasks=specs, task_manager=manager, limit=LIMIT,
                                       log_samples=True)


def _assert_same(ours: dict, our_samples: list[dict], theirs: dict, rel: float | None = None) -> None:
    """The same scores, generations and greedy flags; each log-likelihood within 1e-5 (and ``rel`` of itself: a
    continuation's log P is a sum over its tokens, up to ~100 here)."""
    for task in TASKS:
        for key in ("acc,none", "acc_norm,none", "exact_match,strip"):
            if key in theirs["results"][task]:
                assert ours["results"][task][key] == theirs["results"][task][key], (task, key)
        for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            if key in theirs["results"][task]:  # exp / ratios of summed log-likelihoods
                assert ours["results"][task][key] == pytest.approx(theirs["results"][task][key], rel=1e-6), key
        mine = sorted((s for s in our_samples if s["task"] == task), key=lambda s: s["doc_id"])
        other = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        assert len(mine) == len(other) == LIMIT
        for a, b in zip(mine, other):
            assert a["doc_id"] == b["doc_id"] and a["target"] == b["target"]
            for (ra,), (rb,) in zip(a["resps"], b["resps"]):
                if isinstance(rb, float):  # loglikelihood_rolling: log P of the whole text
                    assert ra == pytest.approx(rb, abs=1e-5, rel=rel or 1e-7)
                elif isinstance(rb, str):
                    assert ra == rb  # the generated text, greedy
                else:
                    assert ra[0] == pytest.approx(rb[0], abs=1e-5, rel=rel) and ra[1] == rb[1]  # log P, is greedy


def test_handle_eval_equals_lm_eval_hf_on_the_export(runs):
    ours, samples = _handle_eval(runs["llama"], "--checkpoint", "2")
    assert ours["handle"]["step"] == 2 and ours["handle"]["weights"].endswith("step-2/model.pt")
    assert ours["handle"]["requests"] == {"loglikelihood": 4 * LIMIT, "generate_until": LIMIT,
                                          "loglikelihood_rolling": LIMIT}
    theirs = _hf_eval(runs["hf"])
    _assert_same(ours, samples, theirs)
    generated = [s["resps"][0][0] for s in samples if s["task"] == TASKS[1]]
    assert any(g.strip() for g in generated), generated  # the model says something: the comparison is not ""
    listed = json.loads(CliRunner().invoke(cli, ["runs", str(runs["llama"].parent), "--json"]).output)
    row = next(r for r in listed if r["name"] == runs["llama"].name)
    assert row["evals"]["step"] == 2
    assert row["evals"]["scores"][TASKS[0]]["acc"] == ours["results"][TASKS[0]]["acc,none"]


def test_lora_adapters_unmerged_equal_the_merged_export(runs):
    ours, samples = _handle_eval(runs["lora"])
    # W x + (α/r) B A x against (W + (α/r) B A) x: rounding differs, 3e-5 of -280 (1e-7 relative) measured
    _assert_same(ours, samples, _hf_eval(runs["lora_merged"]), rel=1e-6)


def test_an_moe_run_equals_its_mixtral_export(runs):
    ours, samples = _handle_eval(runs["moe"])
    assert json.loads((runs["moe_hf"] / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    _assert_same(ours, samples, _hf_eval(runs["moe_hf"]), rel=1e-6)


def test_a_2017_decoder_scores_as_its_own_forward_and_greedy_generate(runs):
    """No Hugging Face class computes it: each log-likelihood is held to the run's model on the request alone
    (unbatched, unpadded) and each generation to ``handle generate``'s greedy ``sample`` (this 2-step model
    repeats one token: the cache itself is held by the Llama run's varied text against transformers')."""
    from torch_handle.infer.generate import load_run, sample

    ours, samples = _handle_eval(runs["classic"])
    loaded = load_run(runs["classic"])
    model, tok = loaded.model.requires_grad_(False), loaded.tokenizer
    scored = 0
    for s in samples:
        if s["task"] == TASKS[0]:
            for (context, continuation), ((log_p, greedy),) in zip(s["arguments"], s["resps"]):
                whole = tok.encode(context + continuation).ids
                cont, ids = whole[len(tok.encode(context).ids):], whole[-(model.args.max_len + 1):]
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([ids[:-1]])), -1)[0, -len(cont):]  # (n, V)
                expected = float(lp.gather(1, torch.tensor(cont)[:, None]).sum())
                assert log_p == pytest.approx(expected, abs=1e-5, rel=1e-6)  # batched, padded: 1e-7 relative
                assert greedy == (lp.argmax(-1).tolist() == cont)
                scored += 1
        elif s["task"] == TASKS[1]:
            (context, _), = s["arguments"]
            prompt = tok.encode(context).ids[-(model.args.max_len - 16):]
            tokens = list(sample(model, prompt, 16, temperature=0))
            tokens = tokens[:tokens.index(EOS_ID)] if EOS_ID in tokens else tokens
            assert s["filtered_resps"][0] == tok.decode(tokens).split("\n")[0].strip()
    assert scored == 4 * LIMIT


@pytest.mark.parametrize("run, args, message", [
    ("llama", ["--tasks", "handle_wikitext_clze", "--include-path", str(TASKS_DIR)],
     "error: unknown task 'handle_wikitext_clze' (close: handle_wikitext_cloze"),
    ("llama", ["--tasks", TASKS[0], "--include-path", str(TASKS_DIR), "--limit", "0"],
     "error: --limit 0: must be at least 1 (documents per task)"),
    ("llama", ["--limit", "5"], "error: --limit needs --tasks"),
    ("llama", ["--tasks", "gone", "--include-path", "{gone}"],
     "error: task gone: data file gone.jsonl not found (relative to {gone} or the working directory"),
    ("translate", ["--tasks", TASKS[0], "--include-path", str(TASKS_DIR)],
     "error: {run}: --tasks scores decoder (language-model) runs, this is an encoder-decoder run"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(runs, run, args, message, tmp_path):
    gone = tmp_path / "tasks"  # a local task whose data file is not there
    gone.mkdir()
    task = (TASKS_DIR / "handle_wikitext_cloze.yaml").read_text()
    (gone / "gone.yaml").write_text(task.replace("handle_wikitext_cloze", "gone").replace("wikitext_cloze", "gone"))
    evals = runs[run] / "evals"
    before = sorted(evals.iterdir()) if evals.exists() else None
    result = CliRunner().invoke(cli, ["eval", str(runs[run]), *[a.format(gone=gone) for a in args]])
    assert result.exit_code == 2 and result.output.startswith(message.format(run=runs[run], gone=gone)), result.output
    assert len(result.output.strip().splitlines()) == 1
    assert (sorted(evals.iterdir()) if evals.exists() else None) == before


def test_an_export_opens_the_run_once(runs, tmp_path, monkeypatch):
    """One loaded run (issue 50): ``handle export`` of a LoRA run, merged, reads its preset and its weights once
    (it read the preset 4 times: the method, two exportability checks, the model), through one ``OpenedRun``
    whose files are each read on first use; ``load_run`` is that object's ``load``."""
    import safetensors.torch

    from torch_handle.config import loader
    from torch_handle.infer.adapter_export import export_run
    from torch_handle.infer.generate import OpenedRun

    reads = {"preset": 0, "weights": 0}
    load_preset, load_file = loader.load_preset, safetensors.torch.load_file

    def counted_preset(*a, **k):
        reads["preset"] += 1
        return load_preset(*a, **k)

    def counted_weights(path, *a, **k):
        reads["weights"] += str(path).startswith(str(runs["lora"]))  # the base's weights are the export's, read apart
        return load_file(path, *a, **k)

    monkeypatch.setattr(loader, "load_preset", counted_preset)
    monkeypatch.setattr(safetensors.torch, "load_file", counted_weights)
    out = export_run(runs["lora"], tmp_path / "merged", merge=True)
    assert out["step"] == 2 and reads == {"preset": 1, "weights": 1}, reads
    run = OpenedRun(runs["llama"], checkpoint=2)
    assert run.load() is run.load() and run.step == 2 and run.template is None
    assert run.preset is run.load().preset and run.tokenizer is run.load().tokenizer
