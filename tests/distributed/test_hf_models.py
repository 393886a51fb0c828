"""Hugging Face models end to end through ``torchrun -m ftrain train``: ``ftrain.models.hf:causal_lm``
(llama and qwen2) under ddp, fsdp, tp and a two-stage pipeline, each run resuming the one before
it from its checkpoint (so every strategy trains, saves, and reads another's step); the first run
starts from ``model.init_from`` (a ``save_pretrained`` directory; under fsdp each rank reads only
the rows of its own shards, about half the bytes each: its first loss is the Hugging Face model's
on that batch; the runs after it keep the setting while
the directory is gone, as a resume does not read it), the last step exports with ``ftrain ckpt
export --format hf`` (again: refused without ``--replace``) and reloads in transformers with the
logits of ftrain's model. The step directory also reads back with plain
PyTorch (``dcp_to_torch_save``; ``dcp.load(..., no_dist=True)`` into a fresh model).

Cost: one chain of four 2-rank torchrun jobs per family (each ~8 s here); the export runs in process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ftrain.models.safetensors_file import read_header

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ftrain.checkpoint.manifest import step_dir_name  # noqa: E402
from ftrain.cli import build_parser  # noqa: E402
from ftrain.config import load_config  # noqa: E402
from ftrain.contract import exits  # noqa: E402
from ftrain.contract.events import read_jsonl  # noqa: E402
from ftrain.model import build_model  # noqa: E402
from ftrain.models.layout import logits_of  # noqa: E402
from ftrain.testbed.jobs import TINY_CONFIG, train_job  # noqa: E402

pytestmark = pytest.mark.dist

FAMILIES = ("llama", "qwen2")
#: [model.args] of a tiny model of each family (vocab_size and max_position_embeddings: TINY's model.*)
ARGS = """
[model.args]
family = "{family}"
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
"""
#: each run resumes the one before it and trains INTERVAL more steps; (strategy overrides, last step)
INTERVAL = 2
CHAIN = (  # fsdp first: it keeps each rank's own copy (ddp would broadcast rank 0's), so rank 1 trains on
    # what rank 0 read from model.init_from and sent it
    ("fsdp", ("--parallel.strategy=fsdp",)),
    ("ddp", ()),
    ("tp", ("--parallel.strategy=tp",)),
    ("pp", ("--parallel.pp_size=2",)),
)


def config_text(family: str) -> str:
    """TINY_CONFIG with the factory: its vocab_size and seq_len stay, its other model sizes go unread."""
    return TINY_CONFIG.replace("[model]\n", '[model]\nfactory = "ftrain.models.hf:causal_lm"\n', 1) + ARGS.format(
        family=family
    )


def job_config(tmp: Path, family: str, *overrides: str):
    path = tmp / f"{family}.toml"
    path.write_text(config_text(family))
    return load_config(path, overrides)


def first_batch(cfg) -> torch.Tensor:
    """The tokens of step 1's global batch (what every strategy's first step reads)."""
    from ftrain.data import build_source
    from ftrain.data.cursor import DataCursor

    source = build_source(cfg.data, cfg.model)
    ids = DataCursor(source.num_samples, cfg.train.global_batch_size, cfg.data.seed).next_global_batch().sample_ids
    return torch.from_numpy(source.sample(ids)).long()


def mean_loss(model, tokens: torch.Tensor, micro: int) -> float:
    """The step's loss as the trainer reports it: the mean of the micro-batches' mean losses."""
    with torch.no_grad():
        losses = [
            F.cross_entropy(logits_of(model(t[:, :-1])).float().flatten(0, 1), t[:, 1:].flatten())
            for t in tokens.split(micro)
        ]
    return float(torch.stack(losses).mean())


@pytest.fixture(scope="module", params=FAMILIES)
def chain(request, tmp_path_factory):
    """Every run of the chain for one family: (cfg, init dir, root, results, events per run)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    cfg = job_config(tmp, family)
    torch.manual_seed(11)
    start = build_model(cfg.model)
    start.save_pretrained(tmp / "init")
    root = tmp / "ckpt"
    runs = []
    for i, (name, overrides) in enumerate(CHAIN):
        events = tmp / f"{name}.events.jsonl"
        if i == 1:  # a resume reads its checkpoint: model.init_from may be gone (docs/models.md)
            (tmp / "init").rename(tmp / "init.moved")
        extra = [f"--model.init_from={tmp / 'init'}"]
        result = train_job(
            tmp / name,
            2,
            f"--checkpoint.uri={root}",
            f"--checkpoint.interval={INTERVAL}",
            f"--train.steps={INTERVAL * (i + 1)}",
            "--train.on_schedule_change=rescale",
            f"--logging.events_path={events}",
            *extra,
            *overrides,
            config=config_text(family),
            timeout_s=180,
        )
        runs.append((name, result, read_jsonl(events)))
    return family, cfg, start, root, runs


def test_every_strategy_trains_checkpoints_and_resumes_the_one_before(chain):
    family, cfg, start, root, runs = chain
    for i, (name, result, events) in enumerate(runs):
        steps = [m["step"] for m in result.metrics]
        if name != "pp":
            assert result.final["layout"]["strategy"] == name
        assert steps == [INTERVAL * i + 1, INTERVAL * i + 2], f"{family}/{name}: {steps}"
        resumed = [e for e in events if e["event"] == "resumed" and e["rank"] == 0]
        if i == 0:
            assert resumed == [], f"{family}/{name} resumed: {resumed}"
        else:
            assert [e["step"] for e in resumed] == [INTERVAL * i], f"{family}/{name}: {resumed}"
    assert (root / step_dir_name(INTERVAL * len(CHAIN))).is_dir()  # older ones: retention's to delete
    assert runs[-1][1].final["layout"]["pp_size"] == 2
    losses = [m["loss"] for _, r, _ in runs for m in r.metrics]
    assert losses[-1] < losses[0] - 0.1, f"{family}: the loss did not move: {losses}"


def start_dir(chain) -> Path:
    return chain[3].parent / "init.moved"  # moved away after the first run (see chain)


def test_init_from_starts_at_the_hugging_face_models_loss(chain):
    family, cfg, start, _, runs = chain
    first = runs[0][1].metrics[0]
    expected = mean_loss(start.eval(), first_batch(cfg), cfg.train.micro_batch_size)
    assert first["loss"] == pytest.approx(expected, abs=1e-5), family
    (loaded,) = [e for e in runs[0][2] if e["event"] == "weights_loaded"]  # rank 0's, with each file's digest
    assert loaded["files"] and all(len(digest) == 64 for digest in loaded["files"].values()), loaded
    # fsdp: each rank read the rows of its own shards, about half of the tensors' bytes, not the file
    data_bytes = sum(e.end - e.begin for e in read_header(start_dir(chain) / "model.safetensors").values())
    read = loaded["read_bytes_by_rank"]
    assert len(read) == 2 and sum(read) >= data_bytes and all(r < 0.6 * data_bytes for r in read), (read, data_bytes)
    # the resumes ran with model.init_from pointing at a directory that was gone: not read, not needed
    assert [e for _, _, events in runs[1:] for e in events if e["event"] == "weights_loaded"] == []


def test_export_hf_reloads_in_transformers_with_ftrains_logits(chain, tmp_path, capsys):
    import transformers

    family, cfg, _, root, runs = chain
    last = INTERVAL * len(CHAIN)
    out = tmp_path / "hf"
    argv = ["ckpt", "export", str(root), str(last), str(out), "--format", "hf"]
    args, rest = build_parser(argv).parse_known_args(argv)  # in process: the command, not a new interpreter
    assert args.func(args, rest) == exits.OK
    assert f"exported step {last}: " in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert args.func(args, rest) == exits.USAGE  # an export there already: refused, untouched
    assert "--replace to replace it whole" in capsys.readouterr().err
    again = [*argv, "--replace"]
    args, rest = build_parser(again).parse_known_args(again)
    assert args.func(args, rest) == exits.OK
    final = runs[-1][1].final["model"]
    ours = build_model(cfg.model)
    ours.load_state_dict(final)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    tokens = first_batch(cfg)[:4, :-1]
    with torch.no_grad():
        torch.testing.assert_close(logits_of(hf.eval()(tokens)), logits_of(ours.eval()(tokens)), atol=1e-5, rtol=0)


def test_a_step_directory_reads_back_with_plain_pytorch(chain, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    family, cfg, _, root, runs = chain
    step_dir = root / step_dir_name(INTERVAL * len(CHAIN))
    final = runs[-1][1].final["model"]
    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert {"model", "optim", "rng.rank0", "rng.rank1"} <= set(whole)
    assert whole["model"].keys() == final.keys()
    assert all(torch.equal(whole["model"][k], final[k]) for k in final)
    fresh = build_model(cfg.model)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    fresh.load_state_dict(state["model"])
    assert all(torch.equal(fresh.state_dict()[k], final[k]) for k in final)


def test_fsdp_shards_each_decoder_layer_as_one_unit(tmp_path):
    """In process, one rank of gloo: fully_shard wraps every ``model.layers[i]`` and the root, nothing else."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ftrain.parallel.parallelize import parallelize
    from ftrain.parallel.strategies import compute_layout

    cfg = job_config(tmp_path, "qwen2", "--parallel.strategy=fsdp")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layout = compute_layout(cfg.parallel, world_size=1, rank=0, local_world_size=1, n_head=None)
        par = parallelize(build_model(cfg.model), cfg, layout, torch.device("cpu"), torch.float32, 8)
        units = [path for path, module in par.model.named_modules() if isinstance(module, FSDPModule)]
        assert units == ["", *(f"model.layers.{i}" for i in range(4))]
    finally:
        dist.destroy_process_group()


def test_export_hf_of_the_reference_gpt_is_a_clear_error(chain, tmp_path, capsys):
    """The manifest's recorded model decides; a GPT's step is refused before it is read."""
    import json
    import shutil

    family, _, _, root, _ = chain
    last = INTERVAL * len(CHAIN)
    copy = Path(shutil.copytree(root / step_dir_name(last), tmp_path / "ckpt" / step_dir_name(last)))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["config"]["model"] |= {"factory": "", "args": {}, "arch": "gpt"}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    argv = ["ckpt", "export", str(tmp_path / "ckpt"), str(last), str(tmp_path / "hf"), "--format", "hf"]
    args, rest = build_parser(argv).parse_known_args(argv)
    assert args.func(args, rest) == exits.USAGE
    assert "the reference GPT has no Hugging Face equivalent" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_under_ddp_init_from_is_read_on_rank_0_and_sent(tmp_path):
    """ddp keeps a whole replica: rank 0 reads ``model.init_from`` and sends the weights (the other
    rank reads nothing); the first loss is the Hugging Face model's."""
    cfg = job_config(tmp_path, "llama")
    torch.manual_seed(11)
    start = build_model(cfg.model)
    start.save_pretrained(tmp_path / "init")
    events = tmp_path / "events.jsonl"
    run = train_job(
        tmp_path / "job",
        2,
        f"--model.init_from={tmp_path / 'init'}",
        "--train.steps=1",
        f"--logging.events_path={events}",
        config=config_text("llama"),
        timeout_s=180,
    )
    expected = mean_loss(start.eval(), first_batch(cfg), cfg.train.micro_batch_size)
    assert run.metrics[0]["loss"] == pytest.approx(expected, abs=1e-5)
    (loaded,) = [e for e in read_jsonl(events) if e["event"] == "weights_loaded"]
    assert loaded["rank"] == 0 and loaded["files"] and loaded["read_bytes_by_rank"] == [], loaded
